"""A node other than node 0 of a multi-node launch (``--nnodes N --node-rank K``, K > 0).

It runs only its scheduler ranks (``tp / N`` followers each): no HTTP server, no tokenizer
manager. It waits until they are ready, then until they exit: node 0 shutting down ends them
with code 0; a rank that fails (its peer or node 0 went away, or it was killed) ends this node
with code 1 and a message saying which rank and why. A signal to this launcher stops its ranks,
which node 0 then reports as a lost node.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import signal
import time
from types import FrameType
from typing import Any

from sglang.srt.environ import envs
from sglang.srt.managers.launcher import rendezvous, resolve_model_path, spawn_ranks, wait_ready
from sglang.srt.managers.startup_status import StartupStatus
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

_POLL_S = 0.2
_SIBLING_GRACE_S = 5.0  # after one rank exits, how long the others get to exit by themselves


def _exit_reason(rank: int, proc: Any) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"rank {rank} (pid {proc.pid}) was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"rank {rank} (pid {proc.pid}) was killed by signal {-code}"
    return f"rank {rank} (pid {proc.pid}) exited with code {code}"


def _stop(procs: list[Any], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():  # ranks ignore SIGTERM (see run_scheduler_process)
            p.kill()
            p.join(timeout=5.0)


def run_worker_node(args: ServerArgs) -> int:
    """``args`` as parsed, with ``node_rank > 0``. Returns the process exit code."""
    args = args.resolved()
    args.validate()
    args = resolve_model_path(args)
    ranks = list(args.local_ranks)
    where = f"node {args.node_rank} of {args.nnodes}"
    status = StartupStatus(mp.get_context("spawn"), ranks)
    init_method, _ = rendezvous(args)  # node 0's TCP store
    procs = spawn_ranks(args, init_method, status)
    atexit.register(_stop, procs, 1.0)
    stop_requested: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop_requested.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        wait_ready(procs, ranks, status, envs.SGLANG_STARTUP_TIMEOUT_S.get())
    except BaseException:
        _stop(procs, timeout_s=1.0)
        raise
    finally:
        status.close()
    logger.info(
        f"{where}: ranks {ranks} joined node 0 at {args.dist_init_addr}; serving until node 0 "
        "shuts down"
    )
    while all(p.exitcode is None for p in procs) and not stop_requested:
        time.sleep(_POLL_S)
    if stop_requested:
        name = signal.Signals(stop_requested[0]).name
        logger.warning(f"{where}: {name}; stopping ranks {ranks} (node 0 will report them lost)")
        for p in procs:
            p.kill()
        _stop(procs)
        return 0
    deadline = time.monotonic() + _SIBLING_GRACE_S
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    _stop(procs, timeout_s=0.0)
    failed = [_exit_reason(r, p) for r, p in zip(ranks, procs) if p.exitcode != 0]
    if not failed:
        logger.info(f"{where}: node 0 shut the ranks down; exiting")
        return 0
    logger.error(f"{where}: {'; '.join(failed)}; the engine cannot run without it, exiting")
    return 1
