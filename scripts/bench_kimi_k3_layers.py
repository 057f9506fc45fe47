"""Kimi K3's KDA and latent-MoE layers at real widths on one GPU, per MoE runner.

KDA: hidden 7168, 96 heads of 128, short conv 4, safe gate: a chunked prefill of ``--prefill``
tokens and one recurrent decode step for ``--batch`` requests. Latent MoE: router on the full
hidden, sigmoid + bias top-16, down-projection to the 3584-wide latent, routed experts with SiTU
(intermediate 3072) on a reduced expert count (``--experts``, 896 in the model) so the weights fit
with room to spare, RMSNorm, up-projection, one shared expert. Random weights; median of CUDA-event
timings. Usage: python scripts/bench_kimi_k3_layers.py [--experts 128] [--runners torch,triton]
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

import torch
from tqdm import tqdm

from bench_moe import random_bf16_experts
from sglang.srt.layers.attention.kda import KDASegment
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_config import KimiK3Config
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.srt.utils.cuda_timing import median_cuda_ms
from sglang.test.random_params import randomize_params_
from sglang.test.release_checkpoint.kimi_k3 import k3_config as release_k3_config


def k3_config(experts: int) -> dict[str, Any]:
    """The release widths (:func:`sglang.test.release_checkpoint.kimi_k3.k3_config`) cut to two
    KDA layers, with ``experts`` routed experts, one shared expert, no AttnRes and a smaller dense
    layer 0 (which this bench never times)."""
    return {
        **release_k3_config(2, num_experts=experts, vocab_size=1024),
        "intermediate_size": 18432,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "num_experts_per_token": 16,
        "num_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "attn_res_block_size": None,
        "linear_attn_config": {
            **release_k3_config(2)["linear_attn_config"],
            "kda_layers": [1, 2],
            "full_attn_layers": [],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--runners", default="torch,triton")
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--batch", default="1,8,32")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    config = KimiK3Config.from_dict(k3_config(args.experts))
    rows: list[tuple[str, str, str, float]] = []
    for runner in tqdm(args.runners.split(","), desc="runners"):
        model = KimiK3ForCausalLM(
            config, LayerBuildSpec(dtype=torch.bfloat16, device="cuda", moe_runner=runner)
        )
        gen = torch.Generator("cuda").manual_seed(0)
        randomize_params_(model, gen, vector_scale=0.5)
        layer = model.decoder_layers[1]
        moe = layer.mlp
        assert isinstance(moe, KimiK3MoE)
        c = moe.experts.config
        w13, w2 = random_bf16_experts(
            c.num_experts,
            c.hidden_size,
            c.intermediate_size,
            gen=gen,
            device="cuda",
            scales=(c.hidden_size**-0.5, c.intermediate_size**-0.5),
        )
        moe.experts.load_weights(ExpertWeights(w13, w2))
        del w13, w2
        x = torch.randn(
            args.prefill, config.hidden_size, generator=gen, device="cuda", dtype=torch.bfloat16
        )
        if runner == args.runners.split(",")[0]:  # KDA does not depend on the MoE runner
            kda = layer.self_attn

            def kda_prefill(kda=kda, x=x, model=model) -> None:
                # a fresh state each call: a prefill starts from an empty cache
                state = model.new_request_cache().layers[1]
                kda(x, [KDASegment(0, args.prefill, state)])

            rows.append(("KDA", "-", f"prefill {args.prefill}", median_cuda_ms(kda_prefill)))
            for b in batches:
                states = [model.new_request_cache().layers[1] for _ in range(b)]
                xb = x[:b]
                rows.append(
                    (
                        "KDA",
                        "-",
                        f"decode bs={b}",
                        median_cuda_ms(
                            partial(kda, xb, [KDASegment(i, 1, s) for i, s in enumerate(states)])
                        ),
                    )
                )
        for m in [args.prefill, *batches]:
            xm = x[:m]
            rows.append(("latent MoE", runner, f"M={m}", median_cuda_ms(partial(moe, xm))))
        del model, moe, layer
        torch.cuda.empty_cache()
    print(
        f"\nKimi K3 layers, hidden 7168, bf16, {args.experts} experts top-16 (latent 3584, inter "
        "3072)"
    )
    print(f"{'layer':<11} {'runner':<7} {'case':<16} {'ms':>9}")
    for layer_name, runner, case, ms in rows:
        print(f"{layer_name:<11} {runner:<7} {case:<16} {ms:>9.3f}")


if __name__ == "__main__":
    main()
