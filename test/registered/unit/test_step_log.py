"""The scheduler's activity line (``managers/step_log.py``): steps split by kind with their mean
time, the generation throughput over the interval, and no line before the interval has passed
or when it is off; plus ``--log-stats-interval`` validation."""

from __future__ import annotations

import pytest

from sglang.srt.managers.step_log import StepLog, step_kind
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=2)


def test_kinds() -> None:
    assert step_kind((1, 1, 1)) == "decode"
    assert step_kind((1, 40, 1)) == "mixed"
    assert step_kind((40, 7)) == "prefill"


def test_a_line_per_interval_with_each_kinds_mean_time() -> None:
    log = StepLog(10.0, started=100.0)
    assert not log.record((1, 1), 0.002, 2, now=101.0)
    assert not log.record((1, 1), 0.004, 2, now=102.0)
    assert not log.record((1, 300), 0.030, 1, now=103.0)
    assert not log.record((), 0.0, 0, now=120.0)  # an empty plan (heartbeat) counts nothing
    assert log.record((500,), 0.050, 1, now=110.5)
    line = log.line(running=2, queued=3, token_usage=0.25, now=110.5)
    assert line == (
        "4 steps (decode 2 at 3.00 ms, mixed 1 at 30.00 ms, prefill 1 at 50.00 ms); "
        "gen throughput 0.6 tok/s; running 2, queued 3, token usage 0.25"
    )
    # the next interval starts empty at the line's time
    assert not log.record((1,), 0.001, 1, now=115.0)
    assert log.line(running=1, queued=0, token_usage=0.0, now=120.5).startswith(
        "1 steps (decode 1 at 1.00 ms); gen throughput 0.1 tok/s"
    )


def test_off() -> None:
    log = StepLog(0.0, started=0.0)
    assert not log.record((1,), 0.001, 1, now=1e9)


def test_bad_interval_is_refused() -> None:
    with pytest.raises(ServerArgsError, match="--log-stats-interval must be >= 0"):
        ServerArgs(device="cpu", log_stats_interval=-1).validate()


if __name__ == "__main__":
    run_this_file(__file__)
