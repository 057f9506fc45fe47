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
    bad = [r for r in results if not r.ok]
    lengths = {n for r in results for n in r.case.prompt_lens}
    rel = max(r.max_err / r.max_ref for r in results)
    print(
        f"\ncases {len(results)} | seeds {len(seeds)} | distinct prompt lengths {len(lengths)} "
        f"(min {min(lengths)}, max {max(lengths)}) | max logit err "
        f"{max(r.max_err for r in results):.2e} (rel {rel:.2e}) | near-ties (margin <= "
        f"{MARGIN_TOL:g}) {sum(r.near_ties for r in results)} | divergences {len(bad)} | "
        f"{time.perf_counter() - started:.0f}s"
    )
    for r in bad:
        print(f"DIVERGED {r.case.label} lengths {r.case.prompt_lens} at {r.first_divergence}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
