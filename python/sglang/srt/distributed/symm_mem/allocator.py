"""The NCCL symmetric-memory pool behind ``--enable-symm-mem``.

One ``torch.cuda.MemPool`` per device, whose segments come from ``ncclMemAlloc`` (cuMem memory).
``use_symmetric_memory(group)`` routes this thread's CUDA allocations into it; on exit, every
segment created since the last registration for that group's pynccl communicator is registered
as an NCCL window with NCCL_WIN_COLL_SYMMETRIC. An all-reduce on that communicator whose buffer
lies in a window then runs NCCL's symmetric kernels.

Rules the callers must keep (NCCL makes them necessary; see docs/symmetric_memory.md):

* Registration is collective: every rank must run the same allocations inside the context, in
  the same order, with the same sizes. A site whose sizes may differ across ranks passes
  ``disabled=True`` (usually ``disabled=not is_allocation_symmetric()``).
* Registration cannot run while a CUDA graph captures. Warm each captured shape up eagerly, on
  the capture stream, inside the context, so capture finds registered cached blocks; a capture
  that needs a new segment raises :class:`SymmetricMemoryError`.
* The pool never shrinks; put only tensors that feed a collective in it.
* Teardown: deregister windows (``release_symmetric_windows``) before destroying the
  communicator, and drop the pool before destroying process groups.

The bookkeeping (segment cursor per communicator, window ranges, capture refusal, suspension)
talks to the pool through the small :class:`SymmetricPool` protocol, so it is tested on CPU with a
fake pool and communicator.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from sglang.srt.distributed.device_communicators.pynccl_library import (
    SYMM_MEM_MIN_NCCL_VERSION,
    format_version,
    require_nccl_version,
)
from sglang.srt.distributed.symm_mem.nccl_pool import (
    FEATURE_FLAG,
    NcclSymmetricPool,
    SymmetricGroup,
    SymmetricMemoryError,
    SymmetricPool,
)
from sglang.srt.distributed.symm_mem.windows import WindowRanges
from sglang.srt.environ import envs
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)

# --- module state --------------------------------------------------------------------------


@dataclass
class _CommState:
    comm: Any  # kept alive so id(comm) stays unique
    windows: WindowRanges = field(default_factory=WindowRanges)
    next_index: int = 0  # first pool-log entry not yet considered for this communicator
    frees_seen: int = 0
    # Every window handle in registration order: the order (same on all ranks) of teardown.
    handles: list[int] = field(default_factory=list)


@dataclass
class _State:
    enabled: bool = False
    pools: dict[int, SymmetricPool] = field(default_factory=dict)
    pool_override: SymmetricPool | None = None
    comms: dict[int, _CommState] = field(default_factory=dict)
    graph_pool_id: Any = None


_state = _State()
_lock = threading.RLock()
_tls = threading.local()


def _active_stack() -> list[SymmetricMemoryContext]:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


# --- enabling ------------------------------------------------------------------------------


def set_symmetric_memory_enabled(enabled: bool) -> None:
    """Turn the feature on or off for this process (from ``--enable-symm-mem``).

    Enabling must happen before NCCL starts: it sets ``NCCL_CUMEM_ENABLE=1`` (windows need cuMem
    memory; NCCL reads the variable once, at its first init) and checks NCCL >= 2.27.3.
    It never touches ``NCCL_NVLS_ENABLE``."""
    if not enabled:
        _state.enabled = False
        return
    previous = os.environ.get("NCCL_CUMEM_ENABLE")
    os.environ["NCCL_CUMEM_ENABLE"] = "1"
    try:
        found = require_nccl_version(SYMM_MEM_MIN_NCCL_VERSION, feature=FEATURE_FLAG)
    except BaseException:
        if previous is None:
            os.environ.pop("NCCL_CUMEM_ENABLE", None)
        else:
            os.environ["NCCL_CUMEM_ENABLE"] = previous
        raise
    if previous not in (None, "1"):
        logger.warning("%s: overriding NCCL_CUMEM_ENABLE=%s with 1", FEATURE_FLAG, previous)
    if tuple(found) < (2, 28, 0):
        log_once(
            logger,
            logging.WARNING,
            f"{FEATURE_FLAG} with NCCL {format_version(found)}: 2.28 or newer is recommended",
        )
    _state.enabled = True


def is_symmetric_memory_enabled() -> bool:
    return _state.enabled


def set_graph_pool_id(pool_id: Any) -> None:
    """Tell the pool which graph-private pool is capturing (``None`` after capture), so a
    context entered during capture can pause it and route to the symmetric pool."""
    _state.graph_pool_id = pool_id


# --- pools ---------------------------------------------------------------------------------


def _device_index(device: int | str | torch.device | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return (
        device.index
        if device.index is not None
        else (torch.cuda.current_device() if device.type == "cuda" else 0)
    )


def get_symmetric_pool(device: int | str | torch.device | None = None) -> SymmetricPool:
    """The process's pool for ``device``, created on first use (one per device, shared by all
    groups, kept for the process lifetime)."""
    with _lock:
        if _state.pool_override is not None:
            return _state.pool_override
        index = _device_index(device)
        pool = _state.pools.get(index)
        if pool is None:
            pool = _state.pools[index] = NcclSymmetricPool(index)
        return pool


def set_symmetric_pool(pool: SymmetricPool | None) -> None:
    """Serve ``pool`` for every device (tests use a fake); ``None`` restores the real pools."""
    with _lock:
        _state.pool_override = pool


def _existing_pool(device: int | str | torch.device | None) -> SymmetricPool | None:
    if _state.pool_override is not None:
        return _state.pool_override
    if device is None and len(_state.pools) == 1:
        return next(iter(_state.pools.values()))
    if device is None and not _state.pools:
        return None
    return _state.pools.get(_device_index(device))


def pool_segments(device: int | str | torch.device | None = None) -> list[tuple[int, int]]:
    """Live pool segments ``(base, size)`` in allocation order (empty if no pool exists)."""
    pool = _existing_pool(device)
    if pool is None:
        return []
    return [(s.base, s.size) for s in pool.segments(0) if s.live]


# --- registration --------------------------------------------------------------------------


def _comm_state(comm: Any) -> _CommState:
    with _lock:
        state = _state.comms.get(id(comm))
        if state is None or state.comm is not comm:
            state = _state.comms[id(comm)] = _CommState(comm)
        return state


def _drop_freed_windows(state: _CommState, pool: SymmetricPool) -> None:
    """A registered segment was freed (only a pool teardown should free): stop treating it as a
    window so no all-reduce is sent there; its handle is still deregistered at teardown."""
    live = {s.base for s in pool.segments(0) if s.live}
    kept = [w for w in state.windows.windows() if w.base in live]
    gone = [w for w in state.windows.windows() if w.base not in live]
    if gone:
        logger.error(
            "%d registered symmetric-pool segment(s) were freed while registered; the pool must "
            "outlive its windows (release_symmetric_windows before dropping the pool)",
            len(gone),
        )
        state.windows.clear()
        for w in kept:
            state.windows.add(w.base, w.size, w.handle)
    state.frees_seen = pool.num_frees()


def _check_symmetric_across_ranks(group: Any, sizes: list[int]) -> None:
    gather = getattr(group, "all_gather_object", None)
    if gather is None:
        return
    everyone = gather(sizes)
    if any(other != sizes for other in everyone):
        raise SymmetricMemoryError(
            "symmetric-pool allocations differ across ranks (new segment sizes per rank: "
            f"{everyone}); an allocation inside use_symmetric_memory is not rank-uniform. Pass "
            "disabled=True at that site (e.g. disabled=not is_allocation_symmetric())."
        )


def register_new_segments(group: Any, comm: Any, pool: SymmetricPool) -> int:
    """Register, on ``comm``, every live pool segment not yet registered there; returns how
    many. Collective: all ranks must call it with the same pending segments."""
    state = _comm_state(comm)
    if state.frees_seen != pool.num_frees() and len(state.windows):
        _drop_freed_windows(state, pool)
    total = pool.num_segments()
    pending = (
        [s for s in pool.segments(state.next_index) if s.live] if total > state.next_index else []
    )
    if envs.SGLANG_DEBUG_SYMM_MEM.get():
        _check_symmetric_across_ranks(group, [s.size for s in pending])
    if not pending:
        state.next_index = max(state.next_index, total)
        return 0
    if pool.is_capturing():
        raise SymmetricMemoryError(
            f"{len(pending)} new symmetric-pool segment(s) ({sum(s.size for s in pending)} bytes) "
            "appeared while a CUDA graph was capturing, and NCCL window registration cannot run "
            "during capture. Warm up every captured shape eagerly, on the capture stream and "
            "inside use_symmetric_memory, before capturing (or preallocate the pool)."
        )
    first = len(state.windows) == 0
    for seg in pending:
        handle = comm.register_window(seg.base, seg.size)
        if handle:
            state.windows.add(seg.base, seg.size, handle)
            state.handles.append(handle)
        else:  # NCCL >= 2.29.2 returns NULL when the communicator lacks symmetric support
            log_once(
                logger,
                logging.WARNING,
                "NCCL returned no window for a symmetric-pool segment: this communicator has no "
                "symmetric support (all GPUs P2P-reachable, NCCL_CUMEM_ENABLE=1 needed); "
                "all-reduces take the regular path",
            )
        state.next_index = seg.index + 1
    state.next_index = max(state.next_index, total)
    if first and len(state.windows):
        logger.info("symmetric memory: first NCCL window registered (%d bytes)", pending[0].size)
    return len(pending)


def release_symmetric_windows(group_or_comm: Any) -> int:
    """Deregister every window of the group's (or communicator's) pynccl communicator; returns
    how many. Call on all ranks, after the last collective and before closing the
    communicator."""
    comm = getattr(group_or_comm, "pynccl_comm", group_or_comm)
    if comm is None:
        return 0
    with _lock:
        state = _state.comms.pop(id(comm), None)
    if state is None or state.comm is not comm:
        return 0
    state.windows.clear()
    handles, state.handles = state.handles, []
    if handles and torch.cuda.is_available():
        device = getattr(comm, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            torch.cuda.synchronize(device)
    for handle in handles:
        comm.deregister_window(handle)
    return len(handles)


def shutdown_symmetric_memory() -> None:
    """Deregister all windows, then drop every pool (process teardown)."""
    with _lock:
        comms = [s.comm for s in _state.comms.values()]
    for comm in comms:
        release_symmetric_windows(comm)
    with _lock:
        pools, _state.pools = list(_state.pools.values()), {}
        _state.graph_pool_id = None
    for pool in pools:
        pool.close()


# --- the context ---------------------------------------------------------------------------


class SymmetricMemoryContext:
    """Routes allocations into the pool while entered; registers new segments on exit."""

    def __init__(self, group: Any, comm: Any, pool: SymmetricPool) -> None:
        self.group = group
        self.comm = comm
        self.pool = pool
        self._route: AbstractContextManager[Any] | None = None
        self._paused_graph_pool: Any = None

    @property
    def routing(self) -> bool:
        return self._route is not None

    def _activate(self) -> None:
        if self.pool.is_capturing():
            graph_pool = _state.graph_pool_id
            if graph_pool is not None:
                self.pool.pause_graph_pool(graph_pool)
                self._paused_graph_pool = graph_pool
            else:
                log_once(
                    logger,
                    logging.WARNING,
                    "use_symmetric_memory entered during CUDA-graph capture without "
                    "set_graph_pool_id(); the graph's pool may take the allocation",
                )
        route = self.pool.route()
        try:
            route.__enter__()
        except BaseException:
            self._resume_graph_pool()
            raise
        self._route = route

    def _deactivate(self) -> None:
        route, self._route = self._route, None
        try:
            if route is not None:
                route.__exit__(None, None, None)
        finally:
            self._resume_graph_pool()

    def _resume_graph_pool(self) -> None:
        paused, self._paused_graph_pool = self._paused_graph_pool, None
        if paused is not None:
            self.pool.resume_graph_pool(paused)

    def __enter__(self) -> SymmetricMemoryContext:  # noqa: PYI034
        stack = _active_stack()
        # Routing twice to one pool is an error in torch; a nested context rides on the outer.
        if not any(ctx.pool is self.pool and ctx.routing for ctx in stack):
            self._activate()
        stack.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack = _active_stack()
        if not stack or stack[-1] is not self:
            raise SymmetricMemoryError("symmetric-memory contexts must exit in LIFO order")
        stack.pop()
        if self.routing:
            self._deactivate()
        # After a failure in the body the ranks may have diverged; registering could hang.
        if exc_type is None:
            register_new_segments(self.group, self.comm, self.pool)


def use_symmetric_memory(
    group: SymmetricGroup | Callable[[], SymmetricGroup | None] | None, disabled: bool = False
) -> AbstractContextManager[Any]:
    """Allocate this thread's tensors in the NCCL symmetric pool for the body.

    A no-op ``nullcontext()`` when the feature is off, ``disabled`` is set, ``group`` is None,
    the group has one rank, or it has no pynccl communicator. ``group`` may be a zero-argument
    callable (only called when the feature is on and not disabled)."""
    if disabled or not _state.enabled:
        return nullcontext()
    resolved: Any = group() if callable(group) and not hasattr(group, "world_size") else group
    if resolved is None or resolved.world_size == 1:
        return nullcontext()
    comm = getattr(resolved, "pynccl_comm", None)
    if comm is None:
        log_once(
            logger,
            logging.WARNING,
            f"{FEATURE_FLAG}: a group of {resolved.world_size} ranks has no pynccl communicator; "
            "its allocations stay in the default allocator",
        )
        return nullcontext()
    return SymmetricMemoryContext(resolved, comm, get_symmetric_pool(resolved.device))


def active_symmetric_memory_context() -> SymmetricMemoryContext | None:
    stack = _active_stack()
    return stack[-1] if stack else None


@contextmanager
def suspend_symmetric_memory() -> Iterator[None]:
    """Send this thread's allocations back to the default allocator for the body (rank-local
    work such as a JIT warm-up on one rank, which must not grow the pool), then resume."""
    suspended = [ctx for ctx in _active_stack() if ctx.routing]
    for ctx in reversed(suspended):
        ctx._deactivate()
    try:
        yield
    finally:
        for ctx in suspended:
            ctx._activate()


# --- queries -------------------------------------------------------------------------------


def _tensor_span(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to just past its last element (strides may skip bytes)."""
    if t.numel() == 0:
        return 0
    if t.is_contiguous():
        return t.numel() * t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)
    return (last + 1) * t.element_size()


def is_tensor_in_symmetric_pool(t: torch.Tensor, group: Any = None) -> bool:
    """Whether all of ``t`` lies in one window registered (on ``group``'s communicator, or on
    any communicator when ``group`` is None). One bisect; no CUDA call."""
    if not _state.comms:
        return False
    nbytes = _tensor_span(t)
    if nbytes == 0:
        return False
    ptr = t.data_ptr()
    if group is not None:
        comm = getattr(group, "pynccl_comm", None)
        state = _state.comms.get(id(comm)) if comm is not None else None
        return state is not None and state.comm is comm and state.windows.contains(ptr, nbytes)
    return any(s.windows.contains(ptr, nbytes) for s in list(_state.comms.values()))


def registered_windows(group: Any = None) -> list[tuple[int, int]]:
    """``(base, size)`` of registered windows in address order (one group's, or all)."""
    if group is not None:
        comm = getattr(group, "pynccl_comm", None)
        state = _state.comms.get(id(comm)) if comm is not None else None
        states = [state] if state is not None and state.comm is comm else []
    else:
        states = list(_state.comms.values())
    return sorted((w.base, w.size) for s in states for w in s.windows.windows())


def prealloc_symmetric_memory_pool(group: Any, gib: float | None = None) -> int:
    """Grow the pool by one registered segment of ``gib`` GiB (default
    ``SGLANG_SYMM_MEM_PREALLOC_GB_SIZE``) and hand it back to the pool's free list, so later
    eager allocations reuse it instead of creating (and registering) many small segments.
    Collective; run it after CUDA-graph capture, on the forward stream. Returns bytes."""
    if gib is None:
        gib = envs.SGLANG_SYMM_MEM_PREALLOC_GB_SIZE.get()
    if gib < 0:
        raise ValueError(f"prealloc size must be >= 0 GiB, got {gib}")
    two_mib = 2 << 20  # torch rounds large segments to 2 MiB; keep every rank's size identical
    nbytes = -(-int(gib * (1 << 30)) // two_mib) * two_mib
    if nbytes == 0:
        return 0
    ctx = use_symmetric_memory(group)
    if isinstance(ctx, nullcontext):
        return 0
    with ctx:
        block = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    del block
    logger.info("symmetric memory: preallocated %.2f GiB in the pool", nbytes / (1 << 30))
    return nbytes
