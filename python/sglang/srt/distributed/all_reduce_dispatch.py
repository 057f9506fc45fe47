"""Which all-reduce implementation a tensor takes, and the size table behind that choice.

The symmetric path (pynccl, in place, on a buffer inside a registered NCCL window) is taken only
when all of these hold: ``--enable-symm-mem`` is on, the group has a pynccl communicator, the
input lies in a window registered on it, its dtype is fp32/fp16/bf16 (what NCCL's symmetric
all-reduce kernels cover), and its byte size is in the ranges where the symmetric kernels were
measured to win for this world size. Everything else takes ``torch.distributed.all_reduce`` on
the group's device group (its own NCCL communicator has no windows, so a pool tensor outside the
table runs NCCL's regular kernels there).

The table is pure data and the decision a pure function of (size, dtype, world size, pool
membership), so all ranks choose the same implementation for the same call.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from sglang.srt.distributed.symm_mem.allocator import (
    is_symmetric_memory_enabled,
    is_tensor_in_symmetric_pool,
)
from sglang.srt.environ import envs
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

KiB = 1 << 10
MiB = 1 << 20

SYMM_ALL_REDUCE_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float32, torch.float16, torch.bfloat16}
)


@dataclass(frozen=True)
class ByteRange:
    """Sizes ``lo <= nbytes < hi``."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi:
            raise ValueError(f"empty or negative byte range [{self.lo}, {self.hi})")

    def __contains__(self, nbytes: object) -> bool:
        return isinstance(nbytes, int) and self.lo <= nbytes < self.hi


# 2x H200 (NV18), NVLS off, NCCL 2.28.9, bf16, in place, CUDA-graph replay of (write + all-reduce);
# scripts/bench_all_reduce.py, docs/performance.md. symm/regular time: 4-32 KiB 0.65-0.91 (win),
# 64 KiB-1 MiB 0.99-1.36 (loss or tie), 2-7 MiB 0.76-0.93 (win), 8 MiB 0.99 (tie), 16-64 MiB
# 1.05-1.23 (loss). Bounds sit between the last win and the first loss/tie (48 KiB, 1.5 MiB,
# 8 MiB); nothing below 4 KiB was measured, so it is left out.
SYMM_ALL_REDUCE_WIN_RANGES: Mapping[int, tuple[ByteRange, ...]] = MappingProxyType(
    {
        2: (ByteRange(4 * KiB, 48 * KiB), ByteRange(1536 * KiB, 8 * MiB)),
    }
)
# World sizes without our own numbers: only the small-message band that every published
# measurement (4 and 8 GPUs included) shows as a win, up to and including 16 KiB.
DEFAULT_SYMM_ALL_REDUCE_WIN_RANGES: tuple[ByteRange, ...] = (ByteRange(4 * KiB, 16 * KiB + 1),)


def symm_all_reduce_win_ranges(world_size: int) -> tuple[ByteRange, ...]:
    return SYMM_ALL_REDUCE_WIN_RANGES.get(world_size, DEFAULT_SYMM_ALL_REDUCE_WIN_RANGES)


def symm_all_reduce_size_wins(nbytes: int, world_size: int) -> bool:
    """Whether the symmetric kernels should get an all-reduce of ``nbytes`` bytes
    (``SGLANG_SYMM_MEM_ALL_REDUCE_POLICY`` can force always/never for measurements)."""
    policy = envs.SGLANG_SYMM_MEM_ALL_REDUCE_POLICY.get()
    if policy == "always":
        return nbytes > 0
    if policy == "never":
        return False
    return any(nbytes in r for r in symm_all_reduce_win_ranges(world_size))


class AllReducePath(str, Enum):
    IDENTITY = "identity"  # one rank: nothing to reduce
    SYMMETRIC = "symmetric"  # pynccl in place on a registered window
    TORCH = "torch"  # torch.distributed.all_reduce on the device (or CPU) group


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


_debug_seen: set[str] = set()


def _debug_not_in_pool(group: Any, x: torch.Tensor, nbytes: int) -> None:
    """Log once per call-site stack: this all-reduce would have been symmetric had its input
    been allocated in the pool."""
    if getattr(group, "rank_in_group", 0) != 0:
        return
    stack = "".join(traceback.format_stack()[:-3])
    if stack in _debug_seen:
        return
    _debug_seen.add(stack)
    logger.warning(
        "SGLANG_DEBUG_SYMM_MEM: all-reduce of %d bytes (%s, world size %d) is not in the "
        "symmetric pool and takes the regular path; allocate it inside use_symmetric_memory. "
        "Call site:\n%s",
        nbytes,
        x.dtype,
        group.world_size,
        stack,
    )


def select_all_reduce_path(group: Any, x: torch.Tensor) -> AllReducePath:
    """The implementation ``group.all_reduce(x)`` uses (no side effects besides debug logs)."""
    if group.world_size == 1:
        return AllReducePath.IDENTITY
    if not is_symmetric_memory_enabled() or getattr(group, "pynccl_comm", None) is None:
        return AllReducePath.TORCH
    if _is_compiling():  # a raw ctypes call cannot be traced
        return AllReducePath.TORCH
    if x.dtype not in SYMM_ALL_REDUCE_DTYPES:
        return AllReducePath.TORCH
    nbytes = x.numel() * x.element_size()
    if not symm_all_reduce_size_wins(nbytes, group.world_size):
        return AllReducePath.TORCH
    if x.is_contiguous() and is_tensor_in_symmetric_pool(x, group):
        return AllReducePath.SYMMETRIC
    if envs.SGLANG_DEBUG_SYMM_MEM.get():
        _debug_not_in_pool(group, x, nbytes)
    return AllReducePath.TORCH


def all_reduce(group: Any, x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over ``group``. Returns the result, which is ``x`` itself (reduced in place) on
    every current path; callers must still use the return value, as a future out-of-place path
    may return a new tensor."""
    path = select_all_reduce_path(group, x)
    if path is AllReducePath.IDENTITY:
        return x
    if path is AllReducePath.SYMMETRIC:
        group.pynccl_comm.all_reduce(x)
        return x
    dist.all_reduce(x, group=group.process_group_for(x))
    return x
