"""The wide Kimi K3 greedy parity sweep (docs/parity.md): random tiny K3 models against the
cache-free reference of ``sglang.test.kimi_k3_reference`` (transformers' Kimi Linear
KDA, the K3 description's AttnRes / NoPE MLA / latent MoE), prompts at the 64-token KDA chunk
boundaries, chunked prefill (the conv state across forwards) and batched greedy decode. Prints one
row per case and the totals; exits 1 on a divergence.

    python scripts/kimi_k3_parity_sweep.py --seeds 30                     # CPU
"""

from __future__ import annotations

import argparse
import sys
import time

from sglang.test.kimi_k3_parity import MARGIN_TOL, KimiResult, random_kimi_case, run_kimi_case
from sglang.test.parity_report import (
    logit_error_summary,
    outcome_summary,
    prompt_lengths_summary,
    report_divergences,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=4)
    args = ap.parse_args()
    head = f"{'case':<48} {'lengths':<12} {'max err':>8} {'near':>4}  first divergence"
    print(head + "\n" + "-" * len(head))
    results: list[KimiResult] = []
    started = time.perf_counter()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    for seed in seeds:
        case = random_kimi_case(
            seed, max_len=args.max_len, num_prompts=args.prompts, new_tokens=args.new_tokens
        )
        r = run_kimi_case(case)
        results.append(r)
        lens = ",".join(map(str, case.prompt_lens))
        div = "-" if r.first_divergence is None else str(r.first_divergence)
        print(f"{case.label:<48} {lens:<12} {r.max_err:8.1e} {r.near_ties:4d}  {div}", flush=True)
    print(
        f"\ncases {len(results)} | seeds {len(seeds)} | {prompt_lengths_summary(results)} | "
        f"{logit_error_summary(results, MARGIN_TOL)} | {outcome_summary(results, started)}"
    )
    return report_divergences(results)


if __name__ == "__main__":
    sys.exit(main())
