"""The scheduler ranks' startup reports to their launcher: one pipe per rank.

Each rank sends one report, ``("ready", rank, info)`` or ``("error", rank, message, traceback)``;
the launcher waits on all pipes at once. Pipes, not a ``multiprocessing.Queue``: a queue holds
three named POSIX semaphores in ``/dev/shm``, which only the launcher (or its resource tracker)
unlinks, so a node whose whole process group is killed (``kill -9 -PGID``, a supervisor's
``KillMode=control-group``) would leave them behind. A pipe lives in the kernel and goes with its
last process; a rank that dies also closes its pipe, which the launcher sees at once.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterable
from multiprocessing.connection import Connection, wait
from typing import Any


class RankStatusSender:
    """A rank's end (picklable into the spawned rank): ``put`` sends its one report."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def put(self, report: tuple[Any, ...]) -> None:
        self._conn.send(report)


class StartupStatus:
    """The launcher's end: ``sender(rank)`` for each rank's process arguments, ``spawned()`` once
    the ranks are started, then ``get(timeout)`` as a queue's (``queue.Empty`` when no report
    came in time)."""

    def __init__(self, ctx: Any, ranks: Iterable[int]) -> None:
        pipes = {rank: ctx.Pipe(duplex=False) for rank in ranks}
        self._recv: dict[int, Connection] = {rank: r for rank, (r, _) in pipes.items()}
        self._send: dict[int, Connection] = {rank: s for rank, (_, s) in pipes.items()}

    def sender(self, rank: int) -> RankStatusSender:
        return RankStatusSender(self._send[rank])

    def spawned(self) -> None:
        """Close the launcher's copies of the ranks' ends: a rank that dies then reads as EOF."""
        for conn in self._send.values():
            conn.close()
        self._send.clear()

    def get(self, timeout: float) -> tuple[Any, ...]:
        """The next report of any rank; ``queue.Empty`` if none arrives within ``timeout``. A
        rank that exited (EOF on its pipe, after any report it sent) is dropped from the wait."""
        deadline = time.monotonic() + timeout
        while True:
            open_ends = [c for c in self._recv.values() if not c.closed]
            ready = wait(open_ends, max(0.0, deadline - time.monotonic()))
            if not ready:
                raise queue.Empty
            for conn in ready:
                assert isinstance(conn, Connection)
                try:
                    report: tuple[Any, ...] = conn.recv()
                    return report
                except (EOFError, OSError):
                    conn.close()

    def close(self) -> None:
        for conn in (*self._recv.values(), *self._send.values()):
            conn.close()
