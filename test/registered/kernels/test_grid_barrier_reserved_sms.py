"""The grid-sync failure itself, on a GPU, with a whole-grid Triton kernel of our own.

A barrier kernel launched with one CTA per resident slot cannot complete while a side-stream
kernel holds one slot: its bounded wait must report a timeout (never hang). The same launch sized
by the MegaMoE SM budget (default reserve 2) must complete, every time.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.moe.sm_budget import mega_moe_sm_budget
from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file

register_cuda_ci(est_time=15, suite="h200-1gpu")

REPEATS = 10
TIMEOUT_MS = 50.0
HOLD_MS = 200.0  # longer than the barrier's deadline, so the held slot never frees in time


@pytest.fixture(scope="module")
def setup() -> tuple[torch.device, object]:
    from sglang.kernels.ops.grid_barrier import barrier_occupancy

    device = torch.device("cuda", torch.cuda.current_device())
    return device, barrier_occupancy(device)


def test_full_grid_completes_when_gpu_is_free(setup: tuple[torch.device, object]) -> None:
    from sglang.kernels.ops.grid_barrier import run_trial

    device, occ = setup
    for _ in range(3):
        result = run_trial(occ.full_grid, timeout_ms=TIMEOUT_MS * 20, hold_ms=None, device=device)
        assert not result.timed_out, f"occupancy {occ} overestimated: the free GPU cannot hold it"


def test_full_grid_times_out_while_side_stream_holds_a_slot(
    setup: tuple[torch.device, object],
) -> None:
    from sglang.kernels.ops.grid_barrier import run_trial

    device, occ = setup
    side = torch.cuda.Stream(device)
    for i in range(REPEATS):
        result = run_trial(
            occ.full_grid, timeout_ms=TIMEOUT_MS, hold_ms=HOLD_MS, device=device, side_stream=side
        )
        assert result.timed_out, f"run {i}: the full grid should not fit beside the held slot"
        assert result.elapsed_ms < HOLD_MS * 5, "the bounded wait must end the launch"


def test_budget_sized_grid_completes_while_side_stream_holds_a_slot(
    setup: tuple[torch.device, object],
) -> None:
    from sglang.kernels.ops.grid_barrier import run_trial

    device, occ = setup
    with envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.override(2):
        budget = mega_moe_sm_budget(device)
    assert budget == occ.num_sms - 2 - (occ.num_sms - 2) % 2
    side = torch.cuda.Stream(device)
    for i in range(REPEATS):
        result = run_trial(
            occ.ctas_per_sm * budget,
            timeout_ms=TIMEOUT_MS,
            hold_ms=HOLD_MS,
            device=device,
            side_stream=side,
        )
        assert not result.timed_out, f"run {i}: the budget-sized grid must complete"
        assert result.elapsed_ms < TIMEOUT_MS, "it must not have waited for the held slot"


def test_timeout_is_reported_as_named_error(setup: tuple[torch.device, object]) -> None:
    from sglang.kernels.ops.grid_barrier import GridSyncTimeout, hold_slots, launch_grid_barrier

    device, occ = setup
    torch.cuda.synchronize(device)
    hold_slots(torch.cuda.Stream(device), HOLD_MS, device)
    launch = launch_grid_barrier(occ.full_grid, TIMEOUT_MS, device)
    torch.cuda.synchronize(device)
    with pytest.raises(GridSyncTimeout, match="SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS"):
        launch.check(occ.num_sms)


if __name__ == "__main__":
    run_this_file(__file__)
