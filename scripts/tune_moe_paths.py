"""Measure every MoE path the ``deep_gemm`` runner's ``auto`` chooses among, at every size
``scripts/bench_moe.py`` covers, and write the path table it reads.

For each expert shape and dtype: ``triton``, ``deep_gemm_contiguous`` and ``deep_gemm_masked``
at each M, each timed the way the engine runs it (``bench_moe.measure_paths``: CUDA-graph replay
up to ``--graph-max-m`` tokens, eager above, the contiguous layout always eager). The table file
(``srt/layers/moe/moe_runner/path_tables/E{E}_H{H}_I{I}_top{k}_{dtype}_{GPU}.json``) keeps the
paths this script does not measure (the MegaMoE kernels, from their own benchmarks) from the
file it replaces, at the buckets measured here. Then ``bench_moe.py --auto`` shows auto against
each forced layout.

Usage (the GPU machine, one shape a call to stay within a few minutes):
  python scripts/tune_moe_paths.py --shapes dsv4 [--dtypes bf16,fp8]
      [--batches 1,8,32,128,512,2048,8192] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench_moe import GRAPH_MAX_M, SHAPES, measure_paths
from sglang.srt.layers.moe.moe_runner.path_table import (
    TABLE_DIR,
    MoeShape,
    read_table,
    table_name,
    write_table,
)

# Paths measured elsewhere; a rewrite keeps their numbers.
KEPT = ("triton_mega", "deep_gemm_mega")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="dsv4,k3")
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--batches", default="1,8,32,128,512,2048,8192")
    parser.add_argument("--graph-max-m", type=int, default=GRAPH_MAX_M)
    parser.add_argument("--out", type=Path, default=TABLE_DIR)
    args = parser.parse_args()
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name()
    batches = [int(b) for b in args.batches.split(",")]
    for shape_key in args.shapes.split(","):
        s = SHAPES[shape_key]
        shape = MoeShape(s.experts, s.top_k, s.hidden, s.inter)
        for dtype in args.dtypes.split(","):
            measured = measure_paths(s, dtype == "fp8", batches, device, args.graph_max_m)
            old = args.out / table_name(shape, dtype, gpu)
            kept = read_table(old)[3] if old.is_file() else {}
            buckets = {
                m: {
                    **{p: us for p, us in kept.get(m, {}).items() if p in KEPT},
                    **{p: us for p, (us, _) in row.items()},
                }
                for m, row in measured.items()
            }
            source = (
                f"scripts/tune_moe_paths.py on {gpu}, torch {torch.__version__}; graph replay up "
                f"to M={args.graph_max_m}, eager above and for the contiguous layout; "
                f"{', '.join(KEPT)} kept from the previous table"
            )
            path = write_table(shape, dtype, gpu, buckets, source, args.out)
            print(f"\n{path}")
            print("| M | " + " | ".join(sorted({p for b in buckets.values() for p in b})) + " |")
            for m, row in sorted(buckets.items()):
                print(
                    f"| {m} | "
                    + " | ".join(f"{p} {us:.0f}" for p, us in sorted(row.items()))
                    + " |"
                )


if __name__ == "__main__":
    main()
