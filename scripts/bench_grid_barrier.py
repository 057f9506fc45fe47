"""Reserved-SM regression on a real GPU: a whole-grid barrier kernel of ours, launched while a
side-stream kernel holds CTA slots, at full residency and at the MegaMoE SM budget.

Prints one table: for each (grid, held slots) case, how many of N launches timed out at the
barrier and the median launch time. Usage: python scripts/bench_grid_barrier.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from tqdm import tqdm

from sglang.kernels.ops.grid_barrier import barrier_occupancy, run_trial
from sglang.srt.environ import envs
from sglang.srt.layers.moe.sm_budget import mega_moe_sm_budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--timeout-ms", type=float, default=50.0)
    parser.add_argument("--hold-ms", type=float, default=200.0)
    args = parser.parse_args()

    device = torch.device("cuda", torch.cuda.current_device())
    occ = barrier_occupancy(device)
    print(
        f"{torch.cuda.get_device_name(device)}: {occ.num_sms} SMs, {occ.ctas_per_sm} barrier "
        f"CTAs/SM ({occ.registers} regs, {occ.shared_bytes} B smem), full grid {occ.full_grid}"
    )
    cases: list[tuple[str, int, int]] = [("full grid, nothing held", occ.full_grid, 0)]
    for reserve in (0, 2, 8):
        with envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.override(reserve):
            budget = mega_moe_sm_budget(device) or occ.num_sms
        for held in (1, 2, 8):
            cases.append(
                (f"reserve {reserve} ({budget} SMs), {held} held", budget * occ.ctas_per_sm, held)
            )

    rows = []
    side = torch.cuda.Stream(device)
    for name, grid, held in tqdm(cases, desc="cases"):
        results = [
            run_trial(
                grid,
                timeout_ms=args.timeout_ms,
                hold_ms=args.hold_ms if held else None,
                device=device,
                side_stream=side,
                held_slots=max(held, 1),
            )
            for _ in range(args.repeats)
        ]
        timeouts = sum(r.timed_out for r in results)
        median = statistics.median(r.elapsed_ms for r in results)
        rows.append((name, grid, held, timeouts, len(results), median))

    print(f"\n{'case':<34} {'grid':>5} {'held':>4} {'timeouts':>10} {'median ms':>10}")
    for name, grid, held, timeouts, n, median in rows:
        print(f"{name:<34} {grid:>5} {held:>4} {timeouts:>4}/{n:<5} {median:>10.3f}")


if __name__ == "__main__":
    main()
