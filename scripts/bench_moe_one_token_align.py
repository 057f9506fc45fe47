"""Batch-1 fused MoE with the one-token align against the sorting align, in one run.

``fused_experts`` at M=1 gives each slot a block of its own (``moe_align_one_token``, one launch);
this times it, under CUDA-graph replay, against the same call with the sort
(``moe_align_block_size``, two launches) swapped in, twice each in turn, for DSv4 and K3 experts in
bf16 and FP8 (the H200 tables pick the tiles).

Usage: python scripts/bench_moe_one_token_align.py [--shapes dsv4,k3] [--dtypes bf16,fp8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
import sglang.kernels.ops.moe.align as moe_align
import sglang.kernels.ops.moe.fused_moe as fm
from bench_moe import SHAPES, make_batch, make_weights
from sglang.kernels.ops.moe.align import moe_align_block_size, moe_align_one_token

ALIGNERS = {"one-token align": moe_align_one_token, "sorting align": moe_align_block_size}


def time_case(key: str, fp8: bool, dev: torch.device) -> dict[str, list[float]]:
    """Both aligners' times (us), two tries each, in turn."""
    shape = SHAPES[key]
    w = make_weights(shape, fp8, dev)
    x, topk = make_batch(shape, 1, dev)
    kw = {
        "w13_scale": w.w13_scale,
        "w2_scale": w.w2_scale,
        "block_shape": w.block_shape,
        "activation": shape.activation,
        "swiglu_limit": 10.0 if shape.activation == "swiglu" else None,
    }

    def run() -> None:
        fm.fused_experts(x, w.w13, w.w2, topk.topk_weights, topk.topk_ids, **kw)

    times: dict[str, list[float]] = {name: [] for name in ALIGNERS}
    try:
        for _ in range(2):
            for name, aligner in ALIGNERS.items():
                # what fused_experts' aligner (moe_align_any_order) calls at M=1
                moe_align.moe_align_one_token = aligner
                times[name].append(round(triton.testing.do_bench_cudagraph(run, rep=100) * 1e3, 1))
    finally:
        moe_align.moe_align_one_token = moe_align_one_token
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="dsv4,k3")
    parser.add_argument("--dtypes", default="bf16,fp8")
    args = parser.parse_args()
    dev = torch.device("cuda")
    print("| shape | dtype | one-token align us | sorting align us |\n|---|---|---|---|")
    for key in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            t = time_case(key, dtype == "fp8", dev)
            print(f"| {key} | {dtype} | {t['one-token align']} | {t['sorting align']} |")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
