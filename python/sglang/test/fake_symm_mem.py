"""CPU stand-ins for the symmetric pool, a pynccl communicator and a group.

They record what the bookkeeping in ``symm_mem.allocator`` asks of them, and reproduce the two
torch behaviours it must respect: only routed allocations create pool segments, and routing one
thread to the same pool twice is an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang.srt.distributed.symm_mem.alloc_shim import PoolSegment


class FakeSymmetricPool:
    def __init__(self, device_index: int = 0, first_base: int = 0x7F00_0000_0000) -> None:
        self.device_index = device_index
        self.log: list[PoolSegment] = []
        self.frees = 0
        self.capturing = False
        self.routing = False
        self.events: list[tuple[str, Any]] = []
        self.closed = False
        self._next_base = first_base

    @contextmanager
    def _route(self) -> Iterator[None]:
        if self.routing:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.routing = True
        self.events.append(("route_enter", None))
        try:
            yield
        finally:
            self.routing = False
            self.events.append(("route_exit", None))

    def route(self) -> Any:
        return self._route()

    def alloc(self, size: int, base: int | None = None) -> PoolSegment:
        """A new segment, as torch would create on a cache miss inside the routed region."""
        if not self.routing:
            raise AssertionError("allocation outside the routed region cannot reach the pool")
        if base is None:
            base = self._next_base
            self._next_base += size + (2 << 20)
        seg = PoolSegment(len(self.log), base, size, self.device_index, True)
        self.log.append(seg)
        return seg

    def free(self, base: int) -> None:
        for i, seg in enumerate(self.log):
            if seg.base == base and seg.live:
                self.log[i] = PoolSegment(seg.index, seg.base, seg.size, seg.device, False)
        self.frees += 1

    def num_segments(self) -> int:
        return len(self.log)

    def segments(self, start: int = 0) -> list[PoolSegment]:
        return [s for s in self.log[start:] if s.device == self.device_index]

    def num_frees(self) -> int:
        return self.frees

    def is_capturing(self) -> bool:
        return self.capturing

    def pause_graph_pool(self, pool_id: Any) -> None:
        self.events.append(("pause_graph_pool", pool_id))

    def resume_graph_pool(self, pool_id: Any) -> None:
        self.events.append(("resume_graph_pool", pool_id))

    def close(self) -> None:
        self.closed = True


class FakeWindowComm:
    def __init__(self, null_windows: bool = False) -> None:
        self.registered: list[tuple[int, int]] = []
        self.deregistered: list[int] = []
        self.all_reduced: list[torch.Tensor] = []
        self.null_windows = null_windows
        self._next_handle = 1

    def register_window(self, ptr: int, size: int) -> int:
        self.registered.append((ptr, size))
        if self.null_windows:
            return 0
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        return handle

    def deregister_window(self, handle: int) -> None:
        self.deregistered.append(handle)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.all_reduced.append(tensor)


@dataclass
class FakeGroup:
    world_size: int = 2
    rank_in_group: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    pynccl_comm: Any = field(default_factory=FakeWindowComm)
    gathered: list[Any] | None = None  # what all_gather_object returns, when set

    def process_group_for(self, x: torch.Tensor) -> Any:
        return None  # tests replace torch.distributed.all_reduce

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.gathered is None:
            return [obj] * self.world_size
        return self.gathered
