"""A benchmark's own ``launch_server``: started in its own process group with its output in a log
file, up once ``/health`` answers (the startup time and one fact of its startup line printed),
stopped with SIGINT to the group (SIGKILL after a grace period)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

STARTUP_TIMEOUT_S = 300.0
STOP_GRACE_S = 60.0


def server_healthy(port: int) -> bool:
    """Whether the server on loopback ``port`` answers ``/health`` with 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def startup_fact(log: Path, fact: str) -> str:
    """What the last log line naming ``fact`` (e.g. ``"prefix cache:"``) says of it, up to its
    ``;`` (`` ?`` when no line names it)."""
    lines = [line for line in log.read_text().splitlines() if fact in line]
    return lines[-1].split(fact)[1].split(";")[0] if lines else " ?"


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the server's process group, SIGKILL if it has not exited after the grace."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def launched_server(
    cmd: Sequence[str],
    port: int,
    log: Path,
    *,
    fact: str,
    label: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` (a ``launch_server`` on ``port``) with its output in ``log`` until the block
    ends; raises with the log's tail when it exits or is not healthy within
    :data:`STARTUP_TIMEOUT_S`."""
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=None if env is None else dict(env),
        )
    try:
        while not server_healthy(port):
            if proc.poll() is not None or time.perf_counter() - started > STARTUP_TIMEOUT_S:
                raise RuntimeError(f"server did not start; see {log}:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        name = "server" if label is None else f"server ({label})"
        print(f"{name} up in {time.perf_counter() - started:.0f}s; {fact}{startup_fact(log, fact)}")
        yield proc
    finally:
        stop_server(proc)
