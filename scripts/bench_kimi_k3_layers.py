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

from sglang.srt.layers.attention.kda import KDASegment
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_config import KimiK3Config
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.srt.utils.cuda_timing import median_cuda_ms
from sglang.test.random_params import randomize_params_


def k3_config(experts: int) -> dict[str, Any]:
    return {
        "model_type": "kimi_linear",
        "vocab_size": 1024,
        "hidden_size": 7168,
        "num_hidden_layers": 2,
        "intermediate_size": 18432,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": experts,
        "num_experts_per_token": 16,
        "num_shared_experts": 1,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "attn_res_block_size": None,
        "linear_attn_config": {
            "kda_layers": [1, 2],
            "full_attn_layers": [],
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
        "tie_word_embeddings": False,
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
        w13 = (
            torch.randn(
                c.num_experts,
                2 * c.intermediate_size,
                c.hidden_size,
                generator=gen,
                device="cuda",
                dtype=torch.bfloat16,
            )
            * c.hidden_size**-0.5
        )
        w2 = (
            torch.randn(
                c.num_experts,
                c.hidden_size,
                c.intermediate_size,
                generator=gen,
                device="cuda",
                dtype=torch.bfloat16,
            )
            * c.intermediate_size**-0.5
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
