"""Tune the fused-MoE kernels per (expert shape, dtype, M bucket) on this GPU; write the tables.

For each case it times, under CUDA-graph replay, the two-launch path with its own configs and the
TMA prefill path (``grouped_gemm_tma.py``) with each candidate: the two GEMMs are swept separately
(gate-up first, then down on the winner's output), for each ``block_m``, and the best pair is timed
whole. The faster path wins the bucket. Tables go to ``python/sglang/kernels/ops/moe/configs/``
(``tuned_configs.py`` reads them), one JSON file per (shape, dtype, device).

Usage: python scripts/tune_fused_moe.py [--shapes dsv4,k3] [--dtypes bf16,fp8]
       [--batches 128,512,2048,8192] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe import SHAPES, Shape, make_batch, make_weights
from sglang.kernels.ops.activation import activation_code
from sglang.kernels.ops.moe.align import moe_align_block_size
from sglang.kernels.ops.moe.fused_moe import fused_experts, get_config
from sglang.kernels.ops.moe.fused_moe_tma import num_sms_of
from sglang.kernels.ops.moe.grouped_gemm_tma import (
    TmaGemmTile,
    TmaMoeConfig,
    launch_down_tma,
    launch_gate_up_tma,
    tma_config_fits,
)
from sglang.kernels.ops.moe.tuned_configs import (
    CONFIG_DIR,
    table_name,
    tma_config_from_dict,
    tma_config_to_dict,
)
from sglang.kernels.ops.quant.fp8 import FP8_DTYPE, per_token_group_quant_fp8

T = TmaGemmTile
# (block_m, gate-up tiles, down tiles). Gate-up computes gate and up side by side, so its
# block_n covers twice the weight rows it names. FP8 K blocks are the 128-wide scale block.
CANDIDATES: dict[str, list[tuple[int, list[TmaGemmTile], list[TmaGemmTile]]]] = {
    "bf16": [
        (
            128,
            [
                T(128, 64, 16, 8, 4),
                T(128, 64, 16, 8, 3),
                T(128, 64, 16, 8, 4, paired=True),
                T(128, 64, 16, 8, 3, paired=True),
            ],
            [T(256, 64, 16, 8, 3), T(256, 64, 16, 8, 4)],
        ),
        (
            64,
            [
                T(128, 64, 16, 4, 4),
                T(128, 64, 16, 4, 4, paired=True),
                T(128, 64, 16, 8, 4, paired=True),
            ],
            [T(256, 64, 16, 4, 3), T(256, 64, 16, 8, 3)],
        ),
    ],
    # 128-row FP8 gate-up tiles spill (two accumulators plus the scaled K-block product):
    # measured 2-4x slower than 64-row ones on the H200, so only 64 rows are swept.
    "fp8": [
        (
            64,
            [
                T(128, 128, 32, 8, 4),
                T(128, 128, 32, 8, 4, paired=True),
                T(128, 128, 32, 4, 4, paired=True),
            ],
            [T(256, 128, 32, 8, 3), T(256, 128, 32, 8, 4)],
        ),
    ],
}
# Each winner is also tried with warp specialisation (where it compiles; a first sweep with
# non-persistent variants too found them within 3% of the persistent ones).
VARIANTS = ({"warp_specialize": True},)


def variant(tile: TmaGemmTile, change: dict[str, bool]) -> TmaGemmTile:
    return TmaGemmTile(**{**tile.__dict__, **change})


def bench_us(fn) -> float:  # type: ignore[no-untyped-def]
    """Median of a short CUDA-graph replay, in us; inf when the config fails to compile/run."""
    try:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3
    except Exception as err:  # noqa: BLE001 -- a tile that does not compile (shared memory, registers) loses
        print(f"    failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
        torch.cuda.synchronize()
        return float("inf")


class Case:
    """One (shape, dtype, M): inputs and the timers of the whole paths and of each GEMM."""

    def __init__(self, shape: Shape, dtype: str, m: int, weights, limit: float | None) -> None:  # type: ignore[no-untyped-def]
        self.shape, self.m, self.w, self.limit = shape, m, weights, limit
        self.fp8 = dtype == "fp8"
        self.dev = torch.device("cuda")
        x, topk = make_batch(shape, m, self.dev)
        self.x, self.ids, self.tw = x, topk.topk_ids.contiguous(), topk.topk_weights.contiguous()
        self.act = activation_code(shape.activation, limit)
        self.common = {
            "w13_scale": weights.w13_scale,
            "w2_scale": weights.w2_scale,
            "block_shape": weights.block_shape,
            "activation": shape.activation,
            "swiglu_limit": limit,
        }
        self.xq, self.xs = per_token_group_quant_fp8(x, 128) if self.fp8 else (x, None)
        self.sms = num_sms_of(self.dev)
        self.slots = m * shape.top_k

    def whole_us(self, cfg: object) -> float:
        w, x = self.w, self.x
        return bench_us(
            lambda: fused_experts(x, w.w13, w.w2, self.tw, self.ids, config=cfg, **self.common)
        )

    def sweep(self, block_m: int, g1s: list[TmaGemmTile], g2s: list[TmaGemmTile]) -> TmaMoeConfig:
        """The fastest gate-up tile, then the fastest down tile on its output."""
        sh, w = self.shape, self.w
        align = moe_align_block_size(self.ids, block_m, sh.experts)
        padded = align[0].shape[0]
        h_dtype = FP8_DTYPE if self.fp8 else self.x.dtype
        h = torch.empty((padded, sh.inter), dtype=h_dtype, device=self.dev)
        hs = None
        if self.fp8:
            hs = torch.empty((padded, sh.inter // 128), dtype=torch.float32, device=self.dev)
        down = torch.empty((self.slots, sh.hidden), dtype=self.x.dtype, device=self.dev)

        def gate_up(tile: TmaGemmTile) -> None:
            launch_gate_up_tma(
                self.xq,
                self.xs,
                w.w13,
                w.w13_scale,
                h,
                hs,
                align,
                num_slots=self.slots,
                top_k=sh.top_k,
                block_m=block_m,
                tile=tile,
                scale_block=128,
                act=self.act,
                limit=self.limit,
                num_sms=self.sms,
            )

        def down_proj(tile: TmaGemmTile) -> None:
            launch_down_tma(
                h,
                hs,
                w.w2,
                w.w2_scale,
                down,
                self.tw,
                align,
                num_slots=self.slots,
                block_m=block_m,
                tile=tile,
                scale_block=128,
                num_sms=self.sms,
            )

        tile1 = best_tile(block_m, g1s, gate_up)
        gate_up(tile1)  # the winner's output feeds the down sweep
        tile2 = best_tile(block_m, g2s, down_proj)
        return TmaMoeConfig(block_m, tile1, tile2)


def best_tile(block_m: int, tiles: list[TmaGemmTile], launch) -> TmaGemmTile:  # type: ignore[no-untyped-def]
    scored = [(bench_us(lambda t=t: launch(t)), t) for t in tiles]
    top = min(scored, key=lambda st: st[0])[1]
    for change in VARIANTS:
        v = variant(top, change)
        scored.append((bench_us(lambda v=v: launch(v)), v))
    scored.sort(key=lambda st: st[0])
    for us, t in scored[:3]:
        print(f"    bm={block_m} {t}: {us:.0f} us")
    return scored[0][1]


def tune_case(  # type: ignore[no-untyped-def]
    shape: Shape, dtype: str, m: int, weights, limit: float | None, fixed: TmaMoeConfig | None
) -> dict[str, object]:
    """One bucket: sweep the TMA tiles (or, with ``fixed``, time that config only) and compare
    with the two-launch path."""
    case = Case(shape, dtype, m, weights, limit)
    old = get_config(
        m, shape.experts, shape.hidden, shape.inter, weights.w13.dtype, top_k=shape.top_k
    )
    t_old = case.whole_us(old)
    best: tuple[float, TmaMoeConfig | None] = (float("inf"), None)
    if fixed is not None:
        best = (case.whole_us(fixed), fixed)
    for block_m, g1s, g2s in CANDIDATES[dtype] if fixed is None else []:
        cfg = case.sweep(block_m, g1s, g2s)
        if tma_config_fits(cfg, shape.hidden, shape.inter, case.fp8, 128):
            continue
        t = case.whole_us(cfg)
        print(f"  M={m} bm={block_m}: whole TMA path {t:.0f} us")
        if t < best[0]:
            best = (t, cfg)
    print(f"  M={m}: two-launch {t_old:.0f} us, best TMA {best[0]:.0f} us")
    if best[1] is not None and best[0] < t_old:
        return {
            "m": m,
            "kernel": "tma",
            "us": round(best[0], 1),
            "two_launch_us": round(t_old, 1),
            "config": tma_config_to_dict(best[1]),
        }
    tma_us = round(best[0], 1) if best[0] < float("inf") else None
    return {"m": m, "kernel": "two_launch", "us": round(t_old, 1), "tma_us": tma_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="dsv4,k3")
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--batches", default="2048,8192", help="M buckets swept")
    parser.add_argument(
        "--check-batches",
        default="128,512",
        help="M buckets where the two-launch path is timed against the smallest swept winner",
    )
    parser.add_argument("--out-dir", default=str(CONFIG_DIR))
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name()
    for shape_key in args.shapes.split(","):
        shape = SHAPES[shape_key]
        limit = 10.0 if shape.activation == "swiglu" else None
        for dtype in args.dtypes.split(","):
            weights = make_weights(shape, dtype == "fp8", torch.device("cuda"))
            print(f"{shape_key} {dtype}")
            swept = [
                tune_case(shape, dtype, int(m), weights, limit, None)
                for m in args.batches.split(",")
            ]
            first = next((b for b in swept if b["kernel"] == "tma"), None)
            fixed = tma_config_from_dict(first["config"]) if first else None
            checked = [
                tune_case(shape, dtype, int(m), weights, limit, fixed)
                for m in args.check_batches.split(",")
                if m and fixed is not None
            ]
            buckets = sorted(checked + swept, key=lambda b: b["m"])
            name = table_name(
                shape.experts, shape.hidden, shape.inter, shape.top_k, dtype, device_name
            )
            table = {
                "device": device_name,
                "shape": {
                    "experts": shape.experts,
                    "top_k": shape.top_k,
                    "hidden": shape.hidden,
                    "inter": shape.inter,
                    "activation": shape.activation,
                },
                "dtype": dtype,
                "triton": triton.__version__,
                "torch": torch.__version__,
                "buckets": buckets,
            }
            (out_dir / name).write_text(json.dumps(table, indent=1) + "\n")
            print(f"wrote {out_dir / name}")
            del weights
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
