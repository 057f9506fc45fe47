"""Where a long Kimi K3 prefill spends its GPU time: the GPU part of TTFT for one prompt and a
per-module breakdown, with the KDA prefill through the chunked Triton kernels and through torch.

The model is K3 at its real widths (``bench_kimi_k3_layers.k3_config``: hidden 7168, KDA 96 heads
of 128 with the safe gate, MLA 64 heads, latent MoE top-16 on a reduced ``--experts`` count)
with three layers: KDA + dense MLP, KDA + MoE, MLA + MoE. Random weights. ``prefill`` is the
whole forward of one ``--tokens`` prompt from an empty cache, median of ``--repeats`` after a
warm-up that compiles every Triton kernel. The breakdown is ``profile_prefill.py``'s (CUDA events
around every module call; ``self`` is a module's time minus its children's).

``--kda`` lists the KDA prefill settings to profile in turn (``SGLANG_K3_KDA_PREFILL``:
``tf32x3``, ``ieee``, ``tf32`` or ``torch``).

Usage: python scripts/profile_prefill_k3.py [--tokens 8192] [--kda tf32x3,torch] [--experts 64]
       [--json OUT.json]   (--smoke: a tiny K3 on the CPU, to check the script)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import torch
from torch import nn

from bench_kimi_k3_layers import k3_config
from profile_prefill import (
    Clock,
    median_run_ms,
    module_gflop,
    module_rows,
    module_times,
    print_module_table,
    time_parts,
)
from sglang.srt.environ import envs
from sglang.srt.layers.attention import kda as kda_module
from sglang.srt.layers.attention.kda import KimiDeltaAttention
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_config import KimiK3Config
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.test.random_params import randomize_params_


def profile_config(experts: int, smoke: bool) -> dict[str, Any]:
    cfg = k3_config(experts)
    cfg["num_hidden_layers"] = 3
    cfg["linear_attn_config"] = {**cfg["linear_attn_config"], "kda_layers": [1, 2]}
    cfg["linear_attn_config"]["full_attn_layers"] = [3]
    if smoke:
        cfg |= {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 16,
            "v_head_dim": 16,
            "moe_intermediate_size": 32,
            "routed_expert_hidden_size": 32,
        }
        cfg["linear_attn_config"] |= {"num_heads": 2, "head_dim": 16}
    return cfg


# (part label, attribute path, method) and (label, module, function) timed in each KDA layer
_KDA_METHODS = (("project", "", "project"), ("finish", "", "finish"))
_KDA_FUNCTIONS = (
    ("conv", kda_module, "causal_conv_prefill"),
    ("conv", kda_module, "kernel_conv_prefill"),
    ("core", kda_module, "kernel_prefill"),
    ("core", kda_module, "kda_chunked"),
)


def time_kda_parts(model: nn.Module, clock: Clock, spans: dict[str, list]) -> Callable[[], None]:
    """Each KDA layer's projections, its conv and its delta-rule core (kernels or torch)."""
    return time_parts(model, KimiDeltaAttention, _KDA_METHODS, _KDA_FUNCTIONS, clock, spans)


def _load_random_experts(model: KimiK3ForCausalLM, gen: torch.Generator) -> None:
    for module in model.modules():
        if not isinstance(module, KimiK3MoE):
            continue
        c = module.experts.config
        dev, dt = module.experts.device, torch.bfloat16
        w13 = torch.randn(
            c.num_experts, 2 * c.intermediate_size, c.hidden_size, generator=gen, device=dev
        )
        w2 = torch.randn(
            c.num_experts, c.hidden_size, c.intermediate_size, generator=gen, device=dev
        )
        module.experts.load_weights(
            ExpertWeights(
                (w13 * c.hidden_size**-0.5).to(dt), (w2 * c.intermediate_size**-0.5).to(dt)
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--kda", default="tf32x3,torch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    cuda = not args.smoke
    device = "cuda" if cuda else "cpu"
    modes = args.kda.split(",")
    accepted = envs.SGLANG_K3_KDA_PREFILL.choices or ()
    for mode in modes:
        if mode not in accepted:
            raise SystemExit(f"--kda takes {', '.join(accepted)}, got {mode!r}")
    cfg = profile_config(args.experts, args.smoke)
    tokens = min(args.tokens, 80) if args.smoke else args.tokens
    config = KimiK3Config.from_dict(cfg)
    model = KimiK3ForCausalLM(config, LayerBuildSpec(dtype=torch.bfloat16, device=device))
    gen = torch.Generator(device).manual_seed(0)
    randomize_params_(model, gen, vector_scale=0.5)
    _load_random_experts(model, gen)
    model.eval()
    ids = torch.randint(0, cfg["vocab_size"], (tokens,), generator=gen, device=device)
    pos = torch.arange(tokens, device=device)
    run = torch.no_grad()(partial(model, ids, pos))
    clock = Clock(cuda)
    name = torch.cuda.get_device_name() if cuda else "cpu (smoke)"
    results = []
    for mode in modes:
        with envs.SGLANG_K3_KDA_PREFILL.override(mode):
            prefill_ms = median_run_ms(run, clock, args.repeats)
            times = module_times(model, run, clock, time_kda_parts)
            gflop = module_gflop(model, run)
        rows = module_rows(times, gflop, 0.0, {})
        title = (
            f"Kimi K3 prefill, {tokens} tokens, layers KDA+dense / KDA+MoE / MLA+MoE, "
            f"{args.experts} experts, KDA prefill {mode}, {name}"
        )
        print_module_table(title, prefill_ms, times["model"][1], rows, args.peak_tflops)
        results.append({"kda": mode, "prefill_ms": prefill_ms, "rows": [asdict(r) for r in rows]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": tokens, "runs": results}, f)


if __name__ == "__main__":
    main()
