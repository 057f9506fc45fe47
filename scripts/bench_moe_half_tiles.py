"""Half tiles against whole row tiles, kernel by kernel, on the Hopper prefill MoE GEMMs.

Times (CUDA-graph replay) the gate-up and down kernels of ``grouped_gemm_tma.py`` at one
(shape, dtype, M) with the same column tiles over five row tilings:
- ``whole 128`` / ``whole 64``: the plain kernels on ``moe_align_block_size`` blocks;
- ``half tiles``: the tile table of ``moe_align_half_tiles`` (128-row tiles, an expert's last one
  64 rows where that covers it);
- ``table, all 128`` / ``table, all 64``: the half-tile kernel (both bodies compiled, a branch per
  tile) fed a table that makes every tile whole (the 128-row blocks) or every tile half (the
  64-row blocks): the cost of the branch and of each body, apart from the padding saved.
Each row prints the rows computed and the useful TFLOP/s (useful rows only).

Usage: python scripts/bench_moe_half_tiles.py [--shape dsv4] [--dtype bf16] [--m 8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe import SHAPES, make_batch, make_weights
from sglang.kernels.ops.activation import activation_code
from sglang.kernels.ops.moe.align import moe_align_block_size, moe_align_half_tiles
from sglang.kernels.ops.moe.fused_moe_tma import num_sms_of
from sglang.kernels.ops.moe.grouped_gemm_tma import TmaGemmTile, launch_down_tma, launch_gate_up_tma
from sglang.kernels.ops.quant.fp8 import FP8_DTYPE, per_token_group_quant_fp8

TILES = {
    "bf16": (TmaGemmTile(128, 64, 16, 8, 4, paired=True), TmaGemmTile(256, 64, 16, 8, 3)),
    "fp8": (
        TmaGemmTile(128, 128, 16, 8, 3, rescale=True),
        TmaGemmTile(128, 128, 16, 8, 4, rescale=True),
    ),
}

Align = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def forced_table(align: Align, block_m: int, half: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A tile table listing ``align``'s blocks as they are (all whole or all half tiles)."""
    _, expert_ids, ntpp = align
    n = expert_ids.shape[0]
    b = torch.arange(n, device=expert_ids.device, dtype=torch.int32)
    table = torch.stack([b * block_m, expert_ids, torch.full_like(b, int(half))], dim=1)
    return table.contiguous(), (ntpp // block_m).to(torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="dsv4", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bf16", choices=sorted(TILES))
    parser.add_argument("--m", type=int, default=8192)
    args = parser.parse_args()
    shape, fp8, dev = SHAPES[args.shape], args.dtype == "fp8", torch.device("cuda")
    w = make_weights(shape, fp8, dev)
    x, topk = make_batch(shape, args.m, dev)
    ids, tw = topk.topk_ids.contiguous(), topk.topk_weights.contiguous()
    slots, sms = args.m * shape.top_k, num_sms_of(dev)
    limit = 10.0 if shape.activation == "swiglu" else None
    act = activation_code(shape.activation, limit)
    g1, g2 = TILES[args.dtype]
    a128 = moe_align_block_size(ids, 128, shape.experts)
    a64 = moe_align_block_size(ids, 64, shape.experts)
    *three, table, n_tiles = moe_align_half_tiles(ids, 128, shape.experts)
    half_align: Align = (three[0], three[1], three[2])
    halves = int(table[: int(n_tiles), 2].sum())
    half_rows = int(n_tiles) * 128 - 64 * halves
    cases = [
        ("whole 128", 128, a128, None, int(a128[2])),
        ("whole 64", 64, a64, None, int(a64[2])),
        ("half tiles", 128, half_align, (table, n_tiles), half_rows),
        ("table, all 128", 128, a128, forced_table(a128, 128, False), int(a128[2])),
        ("table, all 64 (half)", 128, a64, forced_table(a64, 64, True), int(a64[2])),
    ]
    flop_up = 2 * slots * shape.hidden * 2 * shape.inter
    flop_down = 2 * slots * shape.inter * shape.hidden
    print(f"{shape.name} {args.dtype} M={args.m}: {slots} routed rows, gate-up {g1}, down {g2}")
    print("| rows | computed rows | gate-up us | TFLOP/s | down us | TFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, block_m, align, tiles, rows in cases:
        p = align[0].shape[0]
        xq, xs = per_token_group_quant_fp8(x, 128) if fp8 else (x, None)
        h = torch.empty((p, shape.inter), dtype=FP8_DTYPE if fp8 else x.dtype, device=dev)
        hs = torch.empty((p, shape.inter // 128), device=dev) if fp8 else None
        down = torch.empty((slots, shape.hidden), dtype=x.dtype, device=dev)
        kw = {"block_m": block_m, "scale_block": 128, "num_sms": sms, "tiles": tiles}

        def gate_up(xq=xq, xs=xs, h=h, hs=hs, align=align, kw=kw) -> None:  # type: ignore[no-untyped-def]
            launch_gate_up_tma(
                xq, xs, w.w13, w.w13_scale, h, hs, align, num_slots=slots, top_k=shape.top_k,
                tile=g1, act=act, limit=limit, **kw,
            )  # fmt: skip

        def down_proj(h=h, hs=hs, down=down, align=align, kw=kw) -> None:  # type: ignore[no-untyped-def]
            launch_down_tma(
                h, hs, w.w2, w.w2_scale, down, tw, align, num_slots=slots, tile=g2, **kw
            )  # fmt: skip

        gate_up()
        down_proj()
        torch.cuda.synchronize()
        t1 = triton.testing.do_bench_cudagraph(gate_up, rep=100) * 1e3
        t2 = triton.testing.do_bench_cudagraph(down_proj, rep=100) * 1e3
        print(
            f"| {name} | {rows} | {t1:.0f} | {flop_up / t1 / 1e6:.0f} | {t2:.0f} "
            f"| {flop_down / t2 / 1e6:.0f} |"
        )


if __name__ == "__main__":
    main()
