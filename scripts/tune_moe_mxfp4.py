"""Tune the MXFP4 W4A16 fused MoE per (expert shape, M bucket) on this GPU; write the tables
``mxfp4_config.py`` reads (``configs/E{E}_H{H}_I{I}_top{k}_mxfp4_{device}.json``).

For each M the whole MoE call is timed under CUDA-graph replay over ``--rotate`` routings (so L2
does not serve the weights), as ``bench_moe_mxfp4.py`` does: first the row tile ``block_m`` (with
and without the hidden states put in dot order ahead of GEMM 1), then GEMM 1's tiles with GEMM 2 on
the default ones, then GEMM 2's tiles with GEMM 1's winner; every candidate passes
``mxfp4_config_fits`` first. The winner and the default rule are timed again in turn at the end
(a first timing can run a few percent slow) and the faster one is stored. ``--merge`` keeps the
table's other buckets, so a long sweep can be split across runs.

Usage: python scripts/tune_moe_mxfp4.py [--shapes dsv4,k3] [--batches 1,2,4,...,8192] [--merge]
       [--rotate 4] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe_mxfp4 import DEFAULT_BATCHES, Batch, Shape, graph_us, shapes
from moe_bench_common import kept_buckets, merged_buckets, table_path, write_tuned_table
from sglang.kernels.ops.moe.fused_moe_mxfp4 import fused_experts_mxfp4_weights
from sglang.kernels.ops.moe.mxfp4_config import (
    DTYPE_KEY,
    Mxfp4GemmTile,
    Mxfp4MoeConfig,
    config_to_dict,
    default_mxfp4_config,
    mxfp4_config_fits,
)
from sglang.kernels.ops.moe.mxfp4_weights import Mxfp4MoeWeights, prepare_mxfp4_moe_weights
from sglang.kernels.ops.moe.tuned_configs import CONFIG_DIR
from sglang.test.mxfp4_experts import random_mxfp4_experts, random_routing

T = Mxfp4GemmTile
# (block_n, group_m, warps, stages). Decode streams weights: how many bytes a CTA keeps in flight
# (column block x pipeline depth) against how many CTAs share the SMs. Prefill is MMA-bound:
# bigger tiles, fewer stages; the column-block visiting order (group_m) is swept on the winner.
DECODE_TILES = [
    T(32, 1, 4, 4), T(32, 1, 4, 6), T(64, 1, 4, 3), T(64, 1, 4, 4), T(64, 1, 4, 6),
    T(128, 1, 4, 3), T(128, 1, 4, 4), T(128, 1, 8, 4), T(256, 1, 8, 3),
]  # fmt: skip
PREFILL_TILES = [
    T(64, 8, 4, 2), T(64, 8, 4, 3), T(64, 8, 4, 4), T(128, 8, 4, 2), T(128, 8, 4, 3),
    T(128, 8, 8, 2), T(128, 8, 8, 3), T(128, 8, 8, 4), T(256, 8, 8, 2),
]  # fmt: skip
GROUP_MS = (1, 4, 16, 32)


def block_ms(rows_per_expert: float) -> tuple[int, ...]:
    """Row tiles worth trying for an expert's average rows (the tile pads every expert's run)."""
    if rows_per_expert <= 16:
        return (16,)
    if rows_per_expert <= 48:
        return (16, 32)
    if rows_per_expert <= 96:
        return (32, 64)
    return (64, 128)


class Case:
    """One (shape, M): its batches and the timer of a whole call."""

    def __init__(self, shape: Shape, weights: Mxfp4MoeWeights, m: int, rotate: int) -> None:
        self.shape, self.weights, self.m = shape, weights, m
        self.batches: list[Batch] = [
            random_routing(m, shape.hidden, shape.experts, shape.top_k, seed=7 * m + r,
                           device="cuda")
            for r in range(rotate)
        ]  # fmt: skip
        self.act = {"activation": shape.activation, "swiglu_limit": shape.swiglu_limit}

    def us(self, cfg: Mxfp4MoeConfig) -> float:
        """Time of one call on ``cfg``; inf when it does not fit, compile or run."""
        if mxfp4_config_fits(cfg, self.shape.hidden, self.shape.inter):
            return float("inf")
        try:
            return graph_us(partial(self._run, cfg), self.batches)
        except Exception as err:  # noqa: BLE001 -- a tile that fails to compile or run loses
            print(f"    {cfg}: failed ({type(err).__name__}: {str(err).splitlines()[0][:100]})")
            torch.cuda.synchronize()
            return float("inf")

    def _run(self, cfg: Mxfp4MoeConfig, x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor,
             out: torch.Tensor) -> None:  # fmt: skip
        fused_experts_mxfp4_weights(x, self.weights, tw, ids, out=out, config=cfg, **self.act)  # type: ignore[arg-type]


def best(case: Case, cands: list[Mxfp4MoeConfig], what: str) -> tuple[float, Mxfp4MoeConfig]:
    scored = sorted(((case.us(c), i, c) for i, c in enumerate(cands)), key=lambda s: s[:2])
    for us, _, c in scored[:3]:
        print(f"  M={case.m} {what}: {us:.1f} us {c}")
    return scored[0][0], scored[0][2]


def tune_bucket(case: Case) -> dict[str, object]:
    shape = case.shape
    default = default_mxfp4_config(case.m, shape.experts, shape.top_k)
    rows = case.m * shape.top_k / shape.experts
    prefill = rows > 16
    # 1. the row tile and where the hidden states are reordered, on the default GEMM tiles
    cands = [
        replace(default, block_m=bm, x_in_dot_order=order)
        for bm in block_ms(rows)
        for order in ((False, True) if prefill else (False,))
    ]
    _, cfg = best(case, [default, *cands], "block_m")
    # 2. GEMM 1's tiles, 3. GEMM 2's (at prefill each then with the other visiting orders)
    tiles = PREFILL_TILES if prefill else DECODE_TILES
    for gemm in ("gemm1", "gemm2"):
        _, cfg = best(case, [cfg] + [replace(cfg, **{gemm: t}) for t in tiles], gemm)
        if prefill:
            tile = getattr(cfg, gemm)
            orders = [replace(cfg, **{gemm: replace(tile, group_m=g)}) for g in GROUP_MS]
            _, cfg = best(case, [cfg, *orders], f"{gemm} group_m")
    # the winner against the default, in turn
    pair = [(case.us(default), case.us(cfg)) for _ in range(2)]
    t_default, t_best = min(a for a, _ in pair), min(b for _, b in pair)
    print(f"  M={case.m}: default {t_default:.1f} us, tuned {t_best:.1f} us")
    winner, us = (cfg, t_best) if t_best < t_default else (default, t_default)
    return {
        "m": case.m,
        "us": round(us, 1),
        "default_us": round(t_default, 1),
        "config": config_to_dict(winner),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="dsv4,k3")
    parser.add_argument("--batches", default=DEFAULT_BATCHES)
    parser.add_argument("--rotate", type=int, default=4)
    parser.add_argument("--k3-experts", type=int, default=384)
    parser.add_argument("--merge", action="store_true", help="keep the table's other buckets")
    parser.add_argument("--out-dir", default=str(CONFIG_DIR))
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    for key in args.shapes.split(","):
        shape = shapes(args.k3_experts)[key]
        path = table_path(out_dir, shape, DTYPE_KEY, device)
        kept = kept_buckets(path, args.merge)
        weights = prepare_mxfp4_moe_weights(
            *random_mxfp4_experts(shape.experts, shape.hidden, shape.inter, device="cuda")
        )
        print(shape.name)
        tuned = {}
        for m in (int(b) for b in args.batches.split(",")):
            tuned[m] = tune_bucket(Case(shape, weights, m, args.rotate))
            torch.cuda.empty_cache()
        write_tuned_table(path, device, shape, DTYPE_KEY, merged_buckets(tuned, kept))
        print(f"wrote {path}")
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
