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
    bad = [r for r in results if not r.ok]
    lengths = {n for r in results for n in r.case.prompt_lens}
    mixes = {tuple(r.case.config["compress_ratios"]) for r in results}
    covered = sum(m in mixes for m in ALL_MIXES)
    rel = max(r.max_err / r.max_ref for r in results)
    print(
        f"cases {len(results)} | seeds {len(seeds)} | paths {','.join(paths)} | distinct prompt "
        f"lengths {len(lengths)} (min {min(lengths)}, max {max(lengths)}) | 1-3 layer mixes "
        f"{covered}/{len(ALL_MIXES)} | greedy steps {sum(r.steps for r in results)} | prefill "
        f"rows {sum(r.positions for r in results)}"
    )
    print(
        f"max logit err {max(r.max_err for r in results):.2e} (rel {rel:.2e}) | near-ties "
        f"(margin <= {args.margin_tol:g}) {sum(r.near_ties for r in results)} | tied top-k "
        f"rows {sum(r.tie_breaks for r in results)} | divergences {len(bad)} | "
        f"{time.perf_counter() - started:.0f}s"
    )
    for r in bad:
        print(f"DIVERGED {r.case.label} lengths {r.case.prompt_lens} at {r.first_divergence}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
