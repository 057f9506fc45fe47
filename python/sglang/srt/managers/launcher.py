"""Start the scheduler processes (one per TP rank of this node) and wait until they are ready.

Layout (as in the reference engines): this process keeps the HTTP server and the tokenizer
manager; each TP rank is a spawned process; rank 0 talks to this process over two one-way pipes
(requests down, outputs up) and broadcasts batch plans to the other ranks over gloo. With
``--nnodes N`` every node's launcher starts its ``tp / N`` ranks; only node 0 has rank 0, the
pipes and this front end (the other nodes run :mod:`worker_node`).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import ModelInfo, ShutdownReq
from sglang.srt.managers.startup_status import StartupStatus
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)


class EngineStartupError(RuntimeError):
    """A scheduler rank failed to start; the message carries its error."""


@dataclass
class SchedulerHandle:
    procs: list[Any]
    to_scheduler: Connection
    from_scheduler: Connection
    model_info: ModelInfo
    status: StartupStatus | None = None  # the ranks' startup reports, closed with the handle
    rendezvous_dir: str | None = None  # torch.distributed's file store, removed with the handle
    stopped: bool = False

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask rank 0 to stop (it tells the others), then make sure every process is gone.
        Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self.to_scheduler.send(ShutdownReq())
        except (OSError, ValueError):
            pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():  # ranks ignore SIGTERM (see run_scheduler_process)
                p.kill()
                p.join(timeout=5.0)
        for conn in (self.to_scheduler, self.from_scheduler):
            try:
                conn.close()
            except OSError:
                pass
        if self.status is not None:
            self.status.close()
            self.status = None
        if self.rendezvous_dir is not None:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
            self.rendezvous_dir = None


def resolve_model_path(args: ServerArgs) -> ServerArgs:
    """Without --model-path: generate (or reuse) the built-in default model and point at it."""
    if args.model_path is not None:
        return args
    from sglang.srt.default_model.generate import DEFAULT_MODEL_NAME, ensure_default_model

    path = ensure_default_model()
    logger.info(
        f"no --model-path: serving the built-in default model ({DEFAULT_MODEL_NAME}, random "
        f"weights, gibberish output) from {path}"
    )
    return args.replace(
        model_path=path, served_model_name=args.served_model_name or DEFAULT_MODEL_NAME
    )


def rendezvous(args: ServerArgs) -> tuple[str, str | None]:
    """torch.distributed's init method, and the temporary directory behind it (None for TCP)."""
    if args.dist_init_addr is not None:
        host, port = args.dist_init_host_port()
        return f"tcp://{f'[{host}]' if ':' in host else host}:{port}", None
    # One node: rendezvous through a file, not a TCP port: a port picked here could be taken by
    # another process before rank 0 binds it (seconds later, after the spawn).
    rendezvous_dir = tempfile.mkdtemp(prefix="sglang-dist-")
    return f"file://{os.path.join(rendezvous_dir, 'store')}", rendezvous_dir


def spawn_ranks(
    args: ServerArgs,
    init_method: str,
    status: StartupStatus,
    recv: Connection | None = None,
    send: Connection | None = None,
) -> list[Any]:
    """Start this node's TP ranks (``args.local_ranks``); rank 0, if here, gets the pipes. Each
    rank reports its startup through ``status``, whose launcher copies of the ranks' ends are
    closed once all are started."""
    from sglang.srt.managers.scheduler_process import run_scheduler_process

    ctx = mp.get_context("spawn")
    procs = []
    for rank in args.local_ranks:
        p = ctx.Process(
            target=run_scheduler_process,
            args=(
                args,
                rank,
                init_method,
                recv if rank == 0 else None,
                send if rank == 0 else None,
                status.sender(rank),
            ),
            name=f"sglang-scheduler-tp{rank}",
            daemon=True,
        )
        p.start()
        procs.append(p)
    status.spawned()
    return procs


def launch_schedulers(args: ServerArgs) -> SchedulerHandle:
    """``args`` must be resolved, validated and have a model path; this node must be node 0."""
    assert args.node_rank == 0, "nodes > 0 start their ranks through worker_node"
    ctx = mp.get_context("spawn")
    down_recv, down_send = ctx.Pipe(duplex=False)
    up_recv, up_send = ctx.Pipe(duplex=False)
    status = StartupStatus(ctx, args.local_ranks)
    init_method, rendezvous_dir = rendezvous(args)
    procs = spawn_ranks(args, init_method, status, down_recv, up_send)
    # Our copies of the child's ends: closing them lets EOF reach whoever is left.
    down_recv.close()
    up_send.close()
    handle = SchedulerHandle(
        procs,
        down_send,
        up_recv,
        model_info=None,
        status=status,
        rendezvous_dir=rendezvous_dir,  # type: ignore[arg-type]
    )
    # Ranks ignore SIGTERM, so multiprocessing's own exit hook (terminate, then join without a
    # timeout) would wait forever for them if the owner never called shutdown (an Engine left
    # to the interpreter's exit); this hook runs before it and kills what is left.
    atexit.register(handle.shutdown, 2.0)
    try:
        ready = wait_ready(
            procs, list(args.local_ranks), status, envs.SGLANG_STARTUP_TIMEOUT_S.get()
        )
        info = ready[0]
        assert info is not None  # rank 0 reports the model it loaded
        handle.model_info = info
    except BaseException:
        handle.shutdown(timeout_s=1.0)
        raise
    return handle


# How long the other ranks' reports are awaited once one rank failed: ranks that fail alike report
# within seconds even on a loaded host; a rank still alive and silent after this is not waited for.
OTHER_RANK_REPORTS_S = 15.0


def _startup_error(
    first: tuple[int, str, str], status: StartupStatus, procs: list[Any], heard: int
) -> EngineStartupError:
    """One message for every rank that failed (they usually fail alike); tracebacks at debug.
    ``heard``: the ranks that had reported before ``first``. The others' reports are awaited
    until each has reported or exited (bounded by :data:`OTHER_RANK_REPORTS_S`)."""
    errors = [first]
    heard += 1
    deadline = time.monotonic() + OTHER_RANK_REPORTS_S
    while heard < len(procs) and time.monotonic() < deadline:
        try:
            kind, rank, *payload = status.get(timeout=0.1)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break  # nobody is left to report
            continue
        heard += 1
        if kind == "error":
            errors.append((rank, payload[0], payload[1]))
    by_message: dict[str, list[int]] = {}
    for rank, message, tb in sorted(errors):
        if message not in by_message:
            logger.debug(f"scheduler rank {rank} failed to start:\n{tb}")
        by_message.setdefault(message, []).append(rank)
    parts = []
    for message, ranks in by_message.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        parts.append(f"scheduler {who}: {message}")
    return EngineStartupError("; ".join(parts) + " (--log-level debug shows the traceback)")


def wait_ready(
    procs: list[Any], ranks: list[int], status: StartupStatus, timeout_s: float
) -> dict[int, ModelInfo | None]:
    """Each rank's report (rank 0's carries the :class:`ModelInfo`); ``procs[i]`` is rank
    ``ranks[i]``. Raises :class:`EngineStartupError` for a failed, dead or late rank."""
    ready: dict[int, ModelInfo | None] = {}
    deadline = time.monotonic() + timeout_s
    while len(ready) < len(procs):
        if time.monotonic() > deadline:
            raise EngineStartupError(
                f"scheduler ranks {sorted(set(ranks) - set(ready))} were not ready "
                f"after {timeout_s:.0f}s (SGLANG_STARTUP_TIMEOUT_S)"
            )
        try:
            kind, rank, *payload = status.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in zip(ranks, procs) if not p.is_alive() and r not in ready]
            if dead:
                try:  # its report may still be in flight
                    kind, rank, *payload = status.get(timeout=2.0)
                except queue.Empty:
                    codes = {r: procs[ranks.index(r)].exitcode for r in dead}
                    raise EngineStartupError(
                        f"scheduler ranks died during startup (exit codes {codes})"
                    ) from None
            else:
                continue
        if kind == "error":
            raise _startup_error((rank, payload[0], payload[1]), status, procs, len(ready))
        ready[rank] = payload[0]
    return ready
