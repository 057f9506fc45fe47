"""The launcher's startup wait: when one rank fails, the other ranks' reports are gathered into one
message, however late they come within the bound, on a simulated clock (no real waiting)."""

from __future__ import annotations

import queue
from typing import Any

import pytest

from sglang.srt.managers import launcher
from sglang.srt.managers.launcher import EngineStartupError, wait_ready
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=2)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Proc:
    def __init__(self, alive: bool) -> None:
        self.alive = alive
        self.exitcode = None if alive else 1

    def is_alive(self) -> bool:
        return self.alive


class _Status:
    """Reports at simulated times; ``get`` advances the clock by its timeout when none is due."""

    def __init__(self, clock: _Clock, reports: list[tuple[float, tuple[Any, ...]]]) -> None:
        self.clock = clock
        self.reports = sorted(reports, key=lambda r: r[0])
        self.empties = 0

    def get(self, timeout: float) -> tuple[Any, ...]:
        if self.reports and self.reports[0][0] <= self.clock.now + timeout:
            at, report = self.reports.pop(0)
            self.clock.now = max(self.clock.now, at)
            return report
        self.clock.now += timeout
        self.empties += 1
        raise queue.Empty


def _error(rank: int) -> tuple[Any, ...]:
    return ("error", rank, "ValueError: 8 attention heads do not split over 3 ranks", "tb")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(launcher.time, "monotonic", c)
    return c


def test_a_slow_rank_failing_alike_joins_the_one_message(clock: _Clock) -> None:
    # rank 2 reports 5 s after rank 0 (a loaded host): still one message naming all three
    status = _Status(clock, [(0.5, _error(0)), (1.0, _error(1)), (5.5, _error(2))])
    procs = [_Proc(alive=True) for _ in range(3)]
    with pytest.raises(EngineStartupError) as err:
        wait_ready(procs, [0, 1, 2], status, timeout_s=600)  # type: ignore[arg-type]
    assert "scheduler ranks [0, 1, 2]: ValueError: 8 attention heads" in str(err.value)


def test_different_failures_are_named_apart(clock: _Clock) -> None:
    other = ("error", 1, "RuntimeError: CUDA out of memory", "tb")
    status = _Status(clock, [(0.1, _error(0)), (0.2, other)])
    with pytest.raises(EngineStartupError) as err:
        wait_ready([_Proc(True), _Proc(True)], [0, 1], status, timeout_s=600)  # type: ignore[arg-type]
    text = str(err.value)
    assert "scheduler rank 0: ValueError" in text and "scheduler rank 1: RuntimeError" in text


def test_a_silent_live_rank_is_waited_for_only_up_to_the_bound(clock: _Clock) -> None:
    status = _Status(clock, [(0.1, _error(0))])
    with pytest.raises(EngineStartupError) as err:
        wait_ready([_Proc(True), _Proc(True)], [0, 1], status, timeout_s=600)  # type: ignore[arg-type]
    assert "scheduler rank 0: ValueError" in str(err.value)
    assert launcher.OTHER_RANK_REPORTS_S <= clock.now < launcher.OTHER_RANK_REPORTS_S + 1.0


def test_no_wait_when_every_other_rank_has_exited(clock: _Clock) -> None:
    status = _Status(clock, [(0.1, _error(0))])
    with pytest.raises(EngineStartupError):
        wait_ready([_Proc(False), _Proc(False)], [0, 1], status, timeout_s=600)  # type: ignore[arg-type]
    assert clock.now < 1.0


def test_a_rank_that_was_ready_is_not_awaited_again(clock: _Clock) -> None:
    status = _Status(clock, [(0.1, ("ready", 1, None)), (0.2, _error(0))])
    with pytest.raises(EngineStartupError) as err:
        wait_ready([_Proc(True), _Proc(True)], [0, 1], status, timeout_s=600)  # type: ignore[arg-type]
    assert "scheduler rank 0" in str(err.value) and clock.now < 1.0


if __name__ == "__main__":
    run_this_file(__file__)
