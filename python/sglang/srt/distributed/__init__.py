"""Process groups and collectives (see ``parallel_state``)."""

from __future__ import annotations

from sglang.srt.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed_environment,
    destroy_model_parallel,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    get_tp_group_or_none,
    get_world_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "GroupCoordinator",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "get_tp_group_or_none",
    "get_world_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "tensor_model_parallel_all_reduce",
]
