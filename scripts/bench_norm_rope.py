"""DeepSeek V4's attention projections with the fused norm + RoPE kernels against the torch ops
they replaced, on the wide bench layer (hidden 4096, 64 heads of 512, q rank 1024, indexer
64 x 128, bf16): ``project`` (q/kv proj + norms + rope), the indexer ``queries`` and ``output``
(inverse rope, wo_a, wo_b), at decode under CUDA-graph replay and at a prefill chunk (eager),
then the kernels of one bs-1 replay of the three with the kernels on.

Usage: PYTHONPATH=python:scripts python scripts/bench_norm_rope.py [--batch 1,16,64]
       [--prefill 8192]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from sglang.srt.layers import norm_rope, rotary_embedding
from sglang.srt.layers.attention.dsv4_attention import DeepseekV4Attention
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.utils.cuda_timing import (
    graph_kernel_table,
    median_cuda_ms,
    median_graph_replay_ms,
)
from sglang.test.random_params import randomize_params_
from sglang.test.wide_dsv4 import wide_dsv4_attention_config

DEV = "cuda"


def wide_attention() -> DeepseekV4Attention:
    cfg = wide_dsv4_attention_config()
    attn = DeepseekV4Attention(cfg, 0, LayerBuildSpec(dtype=torch.bfloat16, device=DEV))
    randomize_params_(attn, torch.Generator(DEV).manual_seed(0), vector_scale=0.1)
    return attn


def set_fused(on: bool, real: Callable[[torch.Tensor], bool]) -> None:
    fn = real if on else (lambda t: False)
    norm_rope.triton_can_run = rotary_embedding.triton_can_run = fn  # type: ignore[assignment]


@torch.no_grad()
def ops(attn: DeepseekV4Attention, t: int) -> dict[str, Callable[[], object]]:
    g = torch.Generator(DEV).manual_seed(t)
    x = torch.randn(t, 4096, generator=g, device=DEV).to(torch.bfloat16)
    pos = torch.randint(0, 65536, (t,), generator=g, device=DEV)
    o = torch.randn(t, 64, 512, generator=g, device=DEV)
    p = attn.project(x, pos)
    idx = attn.indexer
    assert idx is not None
    return {
        "q/kv proj + norms + rope": lambda: attn.project(x, pos),
        "indexer queries": lambda: idx.queries(p.q_lora, x, p.cos, p.sin),
        "output: inv rope, wo_a, wo_b": lambda: attn.output(o, p, torch.bfloat16),
        "all three": lambda: (
            attn.project(x, pos),
            idx.queries(p.q_lora, x, p.cos, p.sin),
            attn.output(o, p, torch.bfloat16),
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--prefill", type=int, default=8192)
    args = ap.parse_args()
    attn = wide_attention()
    real = norm_rope.triton_can_run
    print(f"{'case':<14} {'op':<30} {'torch us':>10} {'fused us':>10} {'speedup':>8}")
    cases = [(f"decode bs{b}", int(b), True) for b in args.batch.split(",")]
    cases.append((f"prefill {args.prefill}", args.prefill, False))
    for name, t, graphed in cases:
        timed: dict[str, list[float]] = {}
        for on in (False, True):
            set_fused(on, real)
            for op, fn in ops(attn, t).items():
                ms = median_graph_replay_ms(fn, 20) if graphed else median_cuda_ms(fn, 5)
                timed.setdefault(op, []).append(ms * 1e3)
        for op, (before, after) in timed.items():
            print(f"{name:<14} {op:<30} {before:>10.1f} {after:>10.1f} {before / after:>7.2f}x")
    set_fused(True, real)
    print(graph_kernel_table(ops(attn, 1)["all three"], "bs 1, fused", top=40))


if __name__ == "__main__":
    main()
