"""Skip tests whose hardware is missing, so one command runs everywhere; and fail a run that
leaves files in /dev/shm (semaphores of multiprocessing queues, torch or NCCL shared memory)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

SHM = Path("/dev/shm")
_SHM_MODES = ("fail", "report", "off")


def _num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shm-leaks",
        choices=_SHM_MODES,
        default="fail",
        help="What to do with files the run leaves in /dev/shm that were not there before and "
        "no live process holds: fail the run (default), report them, or not look.",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = _num_gpus()
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))
        need = item.get_closest_marker("needs_gpus")
        if need is not None and gpus < int(need.args[0]):
            item.add_marker(pytest.mark.skip(reason=f"needs {need.args[0]} CUDA GPUs"))


# --- /dev/shm leftovers -------------------------------------------------------------------------


def _shm_names() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:  # no /dev/shm (not Linux): nothing to check
        return set()


def _held_inodes() -> set[int]:
    """Inodes under /dev/shm that a live process maps or has open: this run's own objects that its
    exit will release, or another run's on the same machine; neither is a leftover. By inode: a
    named semaphore's creator maps it under a temporary name that is already unlinked."""
    held: set[int] = set()
    shm_dev = SHM.stat().st_dev
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    if f" {SHM}/" in line:  # address perms offset dev inode path
                        held.add(int(line.split()[4]))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if st.st_dev == shm_dev:
                    held.add(st.st_ino)
        except (OSError, ValueError, IndexError):  # the process ended, or is not ours to read
            continue
    return held


def _unheld(names: set[str]) -> list[str]:
    held = _held_inodes()
    left = []
    for name in sorted(names):
        try:
            if (SHM / name).stat().st_ino not in held:
                left.append(name)
        except OSError:  # removed meanwhile
            continue
    return left


class ShmWatch:
    """What /dev/shm held when the run started, and after which test each new name appeared."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.before = _shm_names()
        self.seen = set(self.before)
        self.first_seen: dict[str, str] = {}
        self.leftovers: list[str] = []

    def after_test(self, nodeid: str) -> None:
        now = _shm_names()
        for name in now - self.seen:
            self.first_seen[name] = nodeid
        self.seen |= now

    def finish(self) -> list[str]:
        new = _shm_names() - self.before
        self.leftovers = _unheld(new) if new else []
        return self.leftovers


_WATCH_KEY = pytest.StashKey[ShmWatch]()


def pytest_configure(config: pytest.Config) -> None:
    mode = config.getoption("--shm-leaks", default="fail")
    if mode != "off" and SHM.is_dir():
        config.stash[_WATCH_KEY] = ShmWatch(mode)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    try:
        return (yield)
    finally:  # after the item's fixtures (and a module's, after its last item) are torn down
        watch = _watch(item.config)
        if watch is not None:
            watch.after_test(item.nodeid)


def _watch(config: pytest.Config) -> ShmWatch | None:
    return config.stash.get(_WATCH_KEY, None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    watch = _watch(session.config)
    if watch is None or not watch.finish():
        return
    if watch.mode == "fail" and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    watch = _watch(terminalreporter.config)
    if watch is None or not watch.leftovers:
        return
    verdict = "the run fails" if watch.mode == "fail" else "reported only"
    terminalreporter.section(f"files left in {SHM} ({verdict})", sep="=", red=True)
    for name in watch.leftovers:
        where = watch.first_seen.get(name, "before the first test ended")
        terminalreporter.line(f"{SHM / name}  (first seen after {where})")
    terminalreporter.line(
        "A spawned process or its resource tracker was killed before unlinking these (a queue or "
        "semaphore of multiprocessing, torch or NCCL shared memory). Fix the test's teardown; "
        "--shm-leaks=report only reports them."
    )
