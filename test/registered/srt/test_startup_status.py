"""The ranks' startup reports (one pipe per rank): a report arrives from a spawned rank, a rank
that exits without one reads as EOF instead of a hang, and the channel puts nothing in /dev/shm
(a multiprocessing queue's named semaphores would outlive a process group killed whole)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
from pathlib import Path

import pytest

from sglang.srt.managers.startup_status import StartupStatus
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=5)


def _shm_mappings() -> list[str]:
    """This process's mappings of /dev/shm files (a named semaphore maps one when created)."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return sorted(line.split(maxsplit=5)[-1] for line in maps if " /dev/shm/" in line)


def test_reports_arrive_and_a_silent_exit_reads_as_eof() -> None:
    ctx = mp.get_context("spawn")
    status = StartupStatus(ctx, [0, 1])
    ready = ctx.Process(target=status.sender(0).put, args=(("ready", 0, {"layers": 4}),))
    silent = ctx.Process(target=os._exit, args=(3,))
    for p in (ready, silent):
        p.start()
    status.spawned()
    try:
        assert status.get(timeout=60) == ("ready", 0, {"layers": 4})
        ready.join(60)
        silent.join(60)
        assert silent.exitcode == 3
        with pytest.raises(queue.Empty):  # rank 1 sent nothing: its pipe's EOF, then nothing
            for _ in range(3):
                status.get(timeout=0.2)
    finally:
        status.close()
        for p in (ready, silent):
            if p.is_alive():
                p.kill()
            p.join(5)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_no_named_semaphore() -> None:
    before = _shm_mappings()
    status = StartupStatus(mp.get_context("spawn"), range(4))
    try:
        assert _shm_mappings() == before
        status.sender(2).put(("error", 2, "boom", "traceback"))
        assert status.get(timeout=5) == ("error", 2, "boom", "traceback")
    finally:
        status.close()


if __name__ == "__main__":
    run_this_file(__file__)
