"""The NCCL symmetric pool itself: a ``torch.cuda.MemPool`` on one GPU whose segments come from
``ncclMemAlloc`` (through the C shim), and the small :class:`SymmetricPool` protocol the
bookkeeping in :mod:`allocator` talks to, so that bookkeeping is tested on CPU with a fake pool.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from sglang.srt.distributed.device_communicators.pynccl_library import (
    NcclLibrary,
    get_nccl_library,
)
from sglang.srt.distributed.symm_mem.alloc_shim import (
    ALLOC_SYMBOL,
    FREE_SYMBOL,
    PoolSegment,
    SymmAllocShim,
    get_shim,
)

FEATURE_FLAG = "--enable-symm-mem"


class SymmetricMemoryError(RuntimeError):
    """Misuse of the symmetric pool that would otherwise hang or silently go wrong."""


# --- what the bookkeeping needs from a pool, a communicator and a group ---------------------


@runtime_checkable
class SymmetricPool(Protocol):
    device_index: int

    def route(self) -> AbstractContextManager[Any]:
        """While entered, this thread's allocations on the pool's device go to the pool."""
        ...

    def num_segments(self) -> int:
        """Length of the append-only segment log (a cursor; counts every device)."""
        ...

    def segments(self, start: int = 0) -> list[PoolSegment]:
        """This device's log entries from ``start`` on, in allocation order."""
        ...

    def num_frees(self) -> int: ...

    def is_capturing(self) -> bool: ...

    def pause_graph_pool(self, pool_id: Any) -> None: ...

    def resume_graph_pool(self, pool_id: Any) -> None: ...

    def close(self) -> None: ...


class SymmetricGroup(Protocol):
    world_size: int
    rank_in_group: int
    device: torch.device
    pynccl_comm: Any


# --- the real pool -------------------------------------------------------------------------


class NcclSymmetricPool:
    """A ``torch.cuda.MemPool`` on one GPU whose segments come from ``ncclMemAlloc``."""

    def __init__(
        self,
        device: int | torch.device,
        shim: SymmAllocShim | None = None,
        library: NcclLibrary | None = None,
    ) -> None:
        if not (hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")):
            raise SymmetricMemoryError(
                f"{FEATURE_FLAG} needs torch >= 2.8 (torch.cuda.MemPool), found {torch.__version__}"
            )
        index = device if isinstance(device, int) else device.index
        if index is None:
            index = torch.cuda.current_device()
        self.device_index = int(index)
        self.device = torch.device("cuda", self.device_index)
        lib = library if library is not None else get_nccl_library()
        self.shim = shim if shim is not None else get_shim()
        self.shim.set_backend(
            lib.function_address("ncclMemAlloc"), lib.function_address("ncclMemFree")
        )
        self._allocator: Any = torch.cuda.memory.CUDAPluggableAllocator(
            self.shim.path, ALLOC_SYMBOL, FREE_SYMBOL
        )
        with torch.cuda.device(self.device):  # a MemPool belongs to the current device
            self._pool: Any = torch.cuda.MemPool(self._allocator.allocator())

    @property
    def mem_pool(self) -> Any:
        if self._pool is None:
            raise SymmetricMemoryError("the symmetric pool was closed")
        return self._pool

    def route(self) -> AbstractContextManager[Any]:
        return torch.cuda.use_mem_pool(self.mem_pool, self.device)

    def num_segments(self) -> int:
        return self.shim.num_segments()

    def segments(self, start: int = 0) -> list[PoolSegment]:
        return [s for s in self.shim.segments(start) if s.device == self.device_index]

    def num_frees(self) -> int:
        return self.shim.num_frees()

    def is_capturing(self) -> bool:
        return bool(torch.cuda.is_current_stream_capturing())

    # While a graph captures, torch routes the capture stream's allocations to the graph's
    # private pool; stop that routing so the symmetric pool gets the tensor, then restore it.
    def pause_graph_pool(self, pool_id: Any) -> None:
        torch._C._cuda_endAllocateToPool(self.device_index, pool_id)

    def resume_graph_pool(self, pool_id: Any) -> None:
        torch._C._cuda_beginAllocateCurrentThreadToPool(self.device_index, pool_id)
        # begin took a reference the capture already holds; give it back so the pool can be
        # freed when its graphs are.
        torch._C._cuda_releasePool(self.device_index, pool_id)

    def close(self) -> None:
        """Drop the MemPool (segments still used by live tensors are freed with them)."""
        if self._pool is not None:
            torch.cuda.synchronize(self.device)
            self._pool = None
            self._allocator = None
