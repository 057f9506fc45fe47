"""The wide DeepSeek V4 greedy parity sweep against transformers (docs/parity.md).

Each seed is one random tiny model (seeds walk through every 1-3 layer mix of sliding / CSA / HCA
layers, hash and routed MoE layers random) and a few prompts cut from one random sequence at the
block, window and top-k boundaries, greedy-decoded through each requested engine path: ``eager``
(per-request caches), ``pooled`` (the slot pool's static decode, padded like a graph batch),
``graph`` (its CUDA-graph replay; CUDA only). Prints one row per case and the totals; exits 1 on a
divergence.

    python scripts/dsv4_parity_sweep.py --seeds 200                       # CPU
    python scripts/dsv4_parity_sweep.py --seeds 200 --device cuda --paths eager,pooled,graph
    python scripts/dsv4_parity_sweep.py --seeds 40 --torch-topk-ties      # transformers' tie order
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from sglang.test.dsv4_parity import ALL_MIXES, CaseResult, format_table, random_case, run_case
from sglang.test.parity_report import (
    logit_error_summary,
    outcome_summary,
    prompt_lengths_summary,
    report_divergences,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--paths", default="eager,pooled")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-len", type=int, default=300)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--margin-tol", type=float, default=1e-4)
    ap.add_argument(
        "--torch-topk-ties",
        action="store_true",
        help="leave the reference indexer's exact ties to torch.topk (shows those divergences)",
    )
    args = ap.parse_args()
    paths = args.paths.split(",")
    if "graph" in paths and args.device != "cuda":
        ap.error("the graph path needs --device cuda")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results: list[CaseResult] = []
    started = time.perf_counter()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    for seed in seeds:
        for path in paths:
            case = random_case(
                seed,
                max_len=args.max_len,
                num_prompts=args.prompts,
                new_tokens=args.new_tokens,
                path=path,  # type: ignore[arg-type]
            )
            r = run_case(
                case,
                device=args.device,
                margin_tol=args.margin_tol,
                tie_rule=not args.torch_topk_ties,
            )
            results.append(r)
            print(format_table([r]).splitlines()[-1], flush=True)
    print()
    print(format_table(results).splitlines()[0])
    mixes = {tuple(r.case.config["compress_ratios"]) for r in results}
    covered = sum(m in mixes for m in ALL_MIXES)
    print(
        f"cases {len(results)} | seeds {len(seeds)} | paths {','.join(paths)} | "
        f"{prompt_lengths_summary(results)} | 1-3 layer mixes {covered}/{len(ALL_MIXES)} | "
        f"greedy steps {sum(r.steps for r in results)} | prefill rows "
        f"{sum(r.positions for r in results)}"
    )
    print(
        f"{logit_error_summary(results, args.margin_tol)} | tied top-k rows "
        f"{sum(r.tie_breaks for r in results)} | {outcome_summary(results, started)}"
    )
    return report_divergences(results)


if __name__ == "__main__":
    sys.exit(main())
