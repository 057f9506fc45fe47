"""The cache readers on a GPU with bf16 rows against FP8 rows (``--kv-cache-dtype``), at DeepSeek
V4's and Kimi K3's widths: DeepSeek V4's decode attention (64 heads of 512, window 128, ratio-4
top-512 picks or every ratio-128 entry), its indexer scores (64 heads of 128) and Kimi K3's
absorbed MLA decode (16 heads, 512 + 64 latents), each at several batch sizes and context lengths.
Prints one table: microseconds a call (CUDA-event timing, median of ``triton.testing.do_bench``)
and the bytes the cache rows take.

Usage: PYTHONPATH=python python scripts/bench_fp8_kv_read.py [--contexts 4096,32768]
       [--batches 1,16,64]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton

from sglang.kernels.ops.attention.absorbed_mla_decode import absorbed_mla_decode
from sglang.kernels.ops.attention.indexer_scores import indexer_scores
from sglang.kernels.ops.attention.sparse_decode_attention import sparse_decode_attention
from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat

RPB = 64  # entries (latents) a block


def _paged(bs: int, rows: int, dim: int, fmt: Fp8RowFormat | None, g: torch.Generator):
    """A block store holding ``rows`` rows for each of ``bs`` slots, bf16 or FP8, and its table."""
    blocks = -(-rows // RPB)
    vals = torch.randn(bs * blocks + 1, RPB, dim, generator=g, device="cuda")
    store = vals.to(torch.bfloat16) if fmt is None else fmt.quantize(vals)
    table = torch.randperm(bs * blocks, generator=g, device="cuda").view(bs, blocks)
    return store, table


def _time(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _line(name: str, bs: int, ctx: int, times: list[float], sizes: tuple[int, int]) -> None:
    print(f"| {name} | {bs} | {ctx} | {times[0]:.1f} | {times[1]:.1f} | {sizes[0]} | {sizes[1]} |")


def _dsv4_attention(bs: int, ctx: int, g: torch.Generator) -> None:
    slots = torch.arange(bs, device="cuda")
    ring = torch.randn(bs + 1, 128, 512, generator=g, device="cuda").bfloat16()
    q = torch.randn(bs, 64, 512, generator=g, device="cuda").bfloat16()
    sink = torch.randn(64, generator=g, device="cuda")
    pos = torch.full((bs,), ctx - 1, device="cuda")
    for ratio in (4, 128):
        n = ctx // ratio
        picks = None
        if ratio == 4:  # the indexer's top 512
            picks = torch.stack(
                [torch.randperm(n, generator=g, device="cuda")[:512] for _ in range(bs)]
            )
        times = []
        for fmt in (None, Fp8RowFormat(512, 64)):
            store, table = _paged(bs, n, 512, fmt, g)

            def call(
                s: torch.Tensor = store, t: torch.Tensor = table, f=fmt, r=ratio, p=picks
            ) -> object:
                return sparse_decode_attention(
                    q, ring, slots, pos, sink, 512**-0.5, entries=s, ratio=r, picks=p,
                    table=t, entry_fp8=f,
                )  # fmt: skip

            times.append(_time(call))
        _line(f"dsv4 decode attention ratio {ratio}", bs, ctx, times, (1024, 584))


def _dsv4_indexer(bs: int, ctx: int, g: torch.Generator) -> None:
    slots = torch.arange(bs, device="cuda")
    n = ctx // 4
    q = torch.randn(bs, 64, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(bs, 64, generator=g, device="cuda")
    vis = torch.full((bs,), n, device="cuda")
    times = []
    for fmt in (None, Fp8RowFormat(128)):
        store, table = _paged(bs, n, 128, fmt, g)

        def call(s: torch.Tensor = store, t: torch.Tensor = table, f=fmt) -> object:
            return indexer_scores(q, w, s, slots, vis, 128**-0.5, table=t, key_fp8=f)

        times.append(_time(call))
    _line("dsv4 indexer scores", bs, ctx, times, (256, 136))


def _k3_absorbed(bs: int, ctx: int, g: torch.Generator) -> None:
    q_lat = torch.randn(bs, 16, 512, generator=g, device="cuda")
    q_pe = torch.randn(bs, 16, 64, generator=g, device="cuda").bfloat16()
    lengths = torch.full((bs,), ctx, device="cuda")
    times = []
    for fmt in (None, Fp8RowFormat(576, 64)):
        store, table = _paged(bs, ctx, 576, fmt, g)

        def call(s: torch.Tensor = store, t: torch.Tensor = table, f=fmt) -> object:
            return absorbed_mla_decode(q_lat, q_pe, s, t, lengths, 192**-0.5, fp8=f)

        times.append(_time(call))
    _line("k3 absorbed MLA decode", bs, ctx, times, (1152, 648))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    print("| kernel | bs | context | bf16 us | FP8 us | bf16 row B | FP8 row B |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        for bs in (int(b) for b in args.batches.split(",")):
            _dsv4_attention(bs, ctx, g)
            _dsv4_indexer(bs, ctx, g)
            _k3_absorbed(bs, ctx, g)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
