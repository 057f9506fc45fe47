"""DeepSeek V4 sparse prefill attention at the bench width (64 heads of 512, window 128, top-512):
the Triton kernel's tilings and probability splits against the torch path, and the indexer's
kernel-scored picks against the torch scoring, on one fresh ``--tokens`` prompt.

For each ratio (4: the indexer's picks; 128: every complete block) prints the torch path's time,
then per kernel variant its time, the useful TFLOP/s (``4 * heads * head_dim`` per key a query
sees; the three-part value product does twice that work) and its worst query's error against the
torch path (``pv_parts`` 3 is exact up to summation order; 2 and 1 keep 16 and 8 bits of each
probability). Times: median of ``--repeats`` CUDA-event timings after a warm-up call.

Usage: python scripts/bench_sparse_prefill.py [--tokens 8192] [--repeats 5]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from sglang.srt.utils.cuda_timing import median_cuda_ms
from sglang.test.sparse_prefill_cases import (
    PrefillCase,
    kernel_path,
    make_inputs,
    max_row_err,
    scoring_indexer,
    torch_path,
)

VARIANTS: list[dict[str, int]] = [
    {},  # the defaults
    {"pv_parts": 2},
    {"pv_parts": 1},
    {"heads_per_program": 32, "num_warps": 8, "num_stages": 1},
    {"heads_per_program": 32, "num_warps": 8, "num_stages": 2},
    {"heads_per_program": 64, "num_warps": 8, "num_stages": 1},
    {"heads_per_program": 16, "block_n": 64, "num_warps": 4, "num_stages": 2},
    {"heads_per_program": 16, "num_warps": 4, "num_stages": 1},
]


def _useful_gflop(case: PrefillCase) -> float:
    p = torch.arange(case.q_first, case.q_first + case.n, dtype=torch.float64)
    keys = torch.clamp(p + 1, max=case.window)
    if case.ratio:
        ent = torch.div(p + 1, case.ratio, rounding_mode="floor")
        keys += torch.clamp(ent, max=case.topk) if case.topk else ent
    return float(keys.sum()) * 4 * case.heads * case.dim / 1e9


def _attention(tokens: int, repeats: int) -> None:
    g = torch.Generator("cuda").manual_seed(0)
    for ratio, topk in ((4, 512), (128, 0)):
        case = PrefillCase(
            n=tokens, heads=64, dim=512, window=128, ratio=ratio, q_first=0, topk=topk
        )
        x = make_inputs(case, "cuda", g)
        ref = torch_path(x)
        gflop = _useful_gflop(case)
        print(f"\nratio {ratio}, {tokens} queries, useful {gflop:.0f} GFLOP")
        print(f"  torch path: {median_cuda_ms(partial(torch_path, x), 1):9.3f} ms")
        for tuning in VARIANTS if ratio == 4 else VARIANTS[:1]:
            label = str(tuning or "defaults")
            try:
                ms = median_cuda_ms(partial(kernel_path, x, **tuning), repeats)
                err = max_row_err(kernel_path(x, **tuning), ref)
            except (CompilationError, OutOfResources, RuntimeError) as e:  # a tiling too big
                print(f"  {label}: failed ({type(e).__name__}: {str(e)[:120]})")
                continue
            print(f"  {label:<66} {ms:9.3f} ms {gflop / ms:7.1f} TFLOP/s worst row err {err:.2e}")


def _indexer(tokens: int, repeats: int) -> None:
    heads, dim, ratio, topk = 64, 128, 4, 512
    indexer = scoring_indexer(heads, dim, ratio, topk, torch.bfloat16, "cuda")
    g = torch.Generator("cuda").manual_seed(1)
    q = torch.randn(tokens, heads, dim, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(tokens, heads, generator=g, device="cuda") * heads**-0.5
    keys = torch.randn(tokens // ratio, dim, generator=g, device="cuda").to(torch.bfloat16)
    pos = torch.arange(tokens, device="cuda")
    print(f"\nindexer, {tokens} queries x {keys.shape[0]} entries, {heads}x{dim}, top-{topk}")
    select = median_cuda_ms(partial(indexer.select, q, w, keys, pos), 1)
    pick = median_cuda_ms(partial(indexer.pick, q, w, keys, pos), repeats)
    print(f"  torch select (mask): {select:9.3f} ms\n  kernel pick (ids):   {pick:9.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    with torch.no_grad():
        _attention(args.tokens, args.repeats)
        _indexer(args.tokens, args.repeats)


if __name__ == "__main__":
    main()
