"""Fused MoE at prefill sizes: ours (the tuned dispatch) against the reference and the targets.

For DeepSeek V4 (E=256 top-6 H=4096 I=2048) and Kimi K3 (E=384 top-16 H=3584 I=3072) experts, bf16
and FP8 128x128, at M = 128, 512, 2048, 8192 tokens: CUDA-graph replay times of
``fused_experts`` as the engine calls it (the per-device table picks two-launch or the TMA kernels)
and of the two-launch path forced (``get_config``), next to the reference (SGLang 0.5.23's Triton
fused MoE with its best H200 configs, ``shared/design/performance_targets.md``). The bf16 and fp8
``torch.matmul`` / ``torch._scaled_mm`` rates (8192^3) and the HBM read and copy bandwidths are
measured in the same run, and each case prints its share of them and its floor: the larger of
(expert weights the routing touches + activations) / bandwidth and FLOPs / the own-dtype matmul
rate. ``ref/floor`` is the most any kernel could beat the reference by; where it is below the
target, the target is past the hardware (``past floor``). Targets: >= 1.2x the
reference at M >= 2048, >= 0.97x at M <= 512, >= 70% of the bf16 matmul rate at M = 8192 (bf16).

Usage: python scripts/bench_moe_prefill.py [--shapes dsv4,k3] [--dtypes bf16,fp8]
       [--batches 1,128,512,2048,8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe import REFERENCE_US, SHAPES, floor_terms, make_batch, make_weights
from sglang.bench_table import markdown_table
from sglang.kernels.ops.moe.fused_moe import (
    check_moe_inputs,
    fused_experts,
    get_config,
    select_chunk_config,
)
from sglang.kernels.ops.moe.grouped_gemm_tma import TmaMoeConfig
from sglang.kernels.ops.quant.fp8 import FP8_DTYPE


def matmul_tflops(fp8: bool) -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if fp8:
        qa, qb = a.to(FP8_DTYPE), b.to(FP8_DTYPE).t().contiguous().t()
        one = torch.ones((), device="cuda")
        ms = triton.testing.do_bench(
            lambda: torch._scaled_mm(qa, qb, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
            rep=200,
        )
    else:
        ms = triton.testing.do_bench(lambda: a @ b, rep=200)
    return 2 * n**3 / (ms * 1e-3) / 1e12


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # Each program reads ITERS consecutive blocks, deep-pipelined, and keeps one sum.
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.range(ITERS, num_stages=4):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def hbm_bytes_per_s() -> float:
    """The best of three 4 GiB probes, per second: a Triton streaming read, torch's sum, and a
    copy (bytes read + written). A floor from a lower bandwidth than a kernel reaches would be no
    floor, so the best one counts."""
    n = 2**31
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    block, iters = 4096, 16
    partial = torch.empty(triton.cdiv(n, block * iters), device="cuda")
    grid = (partial.numel(),)
    stream_ms = triton.testing.do_bench(
        lambda: _stream_read_kernel[grid](x, partial, n, BLOCK=block, ITERS=iters, num_warps=8),
        rep=200,
    )
    sum_ms = triton.testing.do_bench(lambda: x.sum(dtype=torch.float32), rep=200)
    half = x[: n // 2]
    dst = torch.empty_like(half)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(half), rep=200)
    rates = {"stream read": 2 * n / stream_ms, "sum": 2 * n / sum_ms, "copy": 2 * n / copy_ms}
    print("HBM: " + ", ".join(f"{k} {v / 1e6:.0f} GB/s" for k, v in rates.items()))
    return max(rates.values()) * 1e3


def measure(shape_key: str, m: int, w, kw: dict[str, object], ceilings):  # type: ignore[no-untyped-def]
    """(reference us, two-launch us, ours us, our path, our TFLOP/s, floor us) at ``m`` tokens;
    ``ceilings`` = (bytes/s, own-dtype FLOP/s)."""
    shape, dev = SHAPES[shape_key], torch.device("cuda")
    x, topk = make_batch(shape, m, dev)
    nbytes, flops = floor_terms(shape, m, topk, w.w13.dtype == FP8_DTYPE)
    floor_us = max(nbytes / ceilings[0], flops / ceilings[1]) * 1e6
    ids, tw = topk.topk_ids, topk.topk_weights
    p = check_moe_inputs(x, w.w13, w.w2, tw, ids, w.w13_scale, w.w2_scale, None, None)
    cfg = select_chunk_config(m, p, w.w13.dtype, dev)
    path = "tma" if isinstance(cfg, TmaMoeConfig) else "two-launch"
    old = get_config(m, p.num_experts, p.hidden, p.inter, w.w13.dtype, top_k=p.top_k)

    def run(c: object) -> None:
        fused_experts(x, w.w13, w.w2, tw, ids, config=c, **kw)

    ours = triton.testing.do_bench_cudagraph(lambda: run(None), rep=100) * 1e3
    two = triton.testing.do_bench_cudagraph(lambda: run(old), rep=100) * 1e3
    tflops = 6.0 * m * shape.top_k * shape.hidden * shape.inter / (ours * 1e-6) / 1e12
    dtype = "fp8" if w.w13.dtype == FP8_DTYPE else "bf16"
    return REFERENCE_US.get((shape_key, dtype, m)), two, ours, path, tflops, floor_us


def target_of(m: int) -> float:
    return 1.2 if m >= 2048 else 0.97


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="dsv4,k3")
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--batches", default="1,128,512,2048,8192")
    args = parser.parse_args()
    dev = torch.device("cuda")
    rates = {"bf16": matmul_tflops(False), "fp8": matmul_tflops(True)}
    print(f"matmul 8192^3: bf16 {rates['bf16']:.0f} TFLOP/s, fp8 {rates['fp8']:.0f} TFLOP/s")
    bandwidth = hbm_bytes_per_s()
    torch.cuda.empty_cache()  # the 4 GiB probe
    rows = []
    for shape_key in args.shapes.split(","):
        shape = SHAPES[shape_key]
        limit = 10.0 if shape.activation == "swiglu" else None
        for dtype in args.dtypes.split(","):
            w = make_weights(shape, dtype == "fp8", dev)
            kw = {
                "w13_scale": w.w13_scale,
                "w2_scale": w.w2_scale,
                "block_shape": w.block_shape,
                "activation": shape.activation,
                "swiglu_limit": limit,
            }
            ceilings = (bandwidth, rates[dtype] * 1e12)
            for m in [int(b) for b in args.batches.split(",")]:
                case = measure(shape_key, m, w, kw, ceilings)
                rows.append((shape_key, dtype, m, *case, rates[dtype]))
            del w
            torch.cuda.empty_cache()
    print("\n" + results_table(rows, rates["bf16"]))


def results_table(rows: list[tuple[Any, ...]], bf16_rate: float) -> str:
    """One line per case (shape, dtype, M, the reference's us or None, two-launch us, ours us,
    path, TFLOP/s, floor us, the dtype's matmul TFLOP/s) against the targets and floors."""
    head = (
        "shape", "dtype", "M", "reference us", "two-launch us", "ours us", "path", "ref/ours",
        "target", "floor us", "ours/floor", "ref/floor", "TFLOP/s", "of bf16 matmul",
        "of own-dtype matmul",
    )  # fmt: skip
    cells = []
    for shape_key, dtype, m, ref, two, ours, path, tflops, floor_us, rate in rows:
        ratio = f"{ref / ours:.2f}" if ref else "-"
        met = ""
        if ref:
            met = " ok" if ref / ours >= target_of(m) else " **no**"
            met += " (past floor)" if ref / floor_us < target_of(m) else ""
        best = f"{ref / floor_us:.2f}" if ref else "-"
        cells.append(
            (
                shape_key,
                dtype,
                m,
                ref or "-",
                f"{two:.0f}",
                f"{ours:.0f}",
                path,
                ratio,
                f"{target_of(m)}x{met}",
                f"{floor_us:.0f}",
                f"{floor_us / ours:.0%}",
                best,
                f"{tflops:.0f}",
                f"{tflops / bf16_rate:.0%}",
                f"{tflops / rate:.0%}",
            )
        )
    return markdown_table(head, cells, align="llrrrrlrrrrrrrr")


if __name__ == "__main__":
    main()
