"""mHC's Sinkhorn alone on an H200: per-thread scalars (``sinkhorn_scalar``) against the
finalize's per-token tile reductions (``sinkhorn_tile``), CUDA-graph replay, median of rounds.

Both compute ``mhc._sinkhorn`` (20 steps); the table gives µs per call and the scalar/tile ratio.
The finalize's Sinkhorn share is what the tile column shows at T = 1.
Usage: python scripts/bench_mhc_sinkhorn.py [--tokens 1,16,64,512] [--iters 20]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from sglang.kernels.ops.layernorm.mhc import _sinkhorn
from sglang.kernels.ops.layernorm.mhc_sinkhorn_scalar import sinkhorn_scalar, sinkhorn_tile
from sglang.srt.utils.cuda_timing import median_graph_replay_ms


def replay_us(fn: Callable[[], object], replays: int = 200) -> float:
    return median_graph_replay_ms(fn, replays) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="1,16,64,512")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    print(f"{'T':>5} {'tile us':>8} {'scalar us':>10} {'scalar/tile':>12} {'max err':>9}")
    for t in (int(x) for x in args.tokens.split(",")):
        c = torch.randn(t, 4, 4, device="cuda") * 3
        ref = _sinkhorn(c.double(), 1e-6, args.iters)
        err = float((sinkhorn_scalar(c, 1e-6, args.iters).double() - ref).abs().max())
        tile = replay_us(lambda c=c: sinkhorn_tile(c, 1e-6, args.iters))
        scalar = replay_us(lambda c=c: sinkhorn_scalar(c, 1e-6, args.iters))
        print(f"{t:>5} {tile:>8.2f} {scalar:>10.2f} {scalar / tile:>12.2f} {err:>9.1e}")


if __name__ == "__main__":
    main()
