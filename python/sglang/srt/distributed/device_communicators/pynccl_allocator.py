"""The symmetric-memory API under its historical path: code written against upstream SGLang
imports ``use_symmetric_memory`` from here. The implementation lives in
:mod:`sglang.srt.distributed.symm_mem`."""

from __future__ import annotations

from sglang.srt.distributed.symm_mem.allocator import (
    SymmetricMemoryContext,
    active_symmetric_memory_context,
    get_symmetric_pool,
    is_symmetric_memory_enabled,
    is_tensor_in_symmetric_pool,
    pool_segments,
    prealloc_symmetric_memory_pool,
    register_new_segments,
    registered_windows,
    release_symmetric_windows,
    set_graph_pool_id,
    set_symmetric_memory_enabled,
    set_symmetric_pool,
    shutdown_symmetric_memory,
    suspend_symmetric_memory,
    use_symmetric_memory,
)
from sglang.srt.distributed.symm_mem.nccl_pool import (
    FEATURE_FLAG,
    NcclSymmetricPool,
    SymmetricMemoryError,
    SymmetricPool,
)

__all__ = [
    "FEATURE_FLAG",
    "NcclSymmetricPool",
    "SymmetricMemoryContext",
    "SymmetricMemoryError",
    "SymmetricPool",
    "active_symmetric_memory_context",
    "get_symmetric_pool",
    "is_symmetric_memory_enabled",
    "is_tensor_in_symmetric_pool",
    "pool_segments",
    "prealloc_symmetric_memory_pool",
    "register_new_segments",
    "registered_windows",
    "release_symmetric_windows",
    "set_graph_pool_id",
    "set_symmetric_memory_enabled",
    "set_symmetric_pool",
    "shutdown_symmetric_memory",
    "suspend_symmetric_memory",
    "use_symmetric_memory",
]
