"""Process groups: the world group, the tensor-parallel (TP) group and, under DP attention, the
attention-TP group.

With ``--enable-dp-attention --dp-size D`` the TP group of ``T`` ranks is cut into ``D``
consecutive attention-TP groups of ``T / D`` ranks: a DP group attends over its own requests with
its attention-TP group, and the MoE still spans the whole TP group. Without DP attention the
attention-TP group is the TP group itself.

A :class:`GroupCoordinator` wraps one set of ranks with a device group (NCCL on GPU, gloo on
CPU), a gloo CPU group (object broadcasts, barriers, the NCCL unique id), and optionally a pynccl
communicator (needed by the symmetric-memory all-reduce; on by default when
``--enable-symm-mem`` is).

Lifecycle: ``init_distributed_environment`` -> ``initialize_model_parallel`` -> ... ->
``destroy_model_parallel`` / ``destroy_distributed_environment``. Teardown deregisters the
group's NCCL windows before closing its communicator, and drops the symmetric pool before the
world process group is destroyed.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from sglang.srt.distributed import all_reduce_dispatch
from sglang.srt.distributed.symm_mem.allocator import (
    is_symmetric_memory_enabled,
    release_symmetric_windows,
    shutdown_symmetric_memory,
)
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)


class GroupCoordinator:
    """One group of ranks. Every rank of the world constructs it with the same
    ``group_ranks`` (creating a torch group is collective over the world); each keeps the group
    that contains it."""

    def __init__(
        self,
        group_ranks: list[list[int]],
        local_rank: int,
        backend: str,
        *,
        use_pynccl: bool = False,
        group_name: str = "group",
        timeout: timedelta | None = None,
    ) -> None:
        self.unique_name = group_name
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        self.backend = backend
        self.device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
        mine: tuple[list[int], ProcessGroup, ProcessGroup] | None = None
        timeout = timeout if timeout is not None else _group_timeout
        for ranks in group_ranks:
            device_group = dist.new_group(ranks, backend=backend, timeout=timeout)
            cpu_group = (
                device_group
                if backend == "gloo"
                else dist.new_group(ranks, backend="gloo", timeout=timeout)
            )
            if self.rank in ranks:
                mine = (list(ranks), device_group, cpu_group)
        if mine is None:
            raise ValueError(f"rank {self.rank} is in none of the groups {group_ranks}")
        self.ranks, self.device_group, self.cpu_group = mine
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(self.rank)

        self.pynccl_comm: Any = None
        if use_pynccl:
            if backend != "nccl":
                raise ValueError(f"a pynccl communicator needs the nccl backend, not {backend}")
            from sglang.srt.distributed.device_communicators.pynccl import PyNcclCommunicator

            self.pynccl_comm = PyNcclCommunicator(self.cpu_group, self.device)

    def __repr__(self) -> str:
        return (
            f"GroupCoordinator({self.unique_name}, ranks={self.ranks}, rank={self.rank}, "
            f"backend={self.backend}, pynccl={self.pynccl_comm is not None})"
        )

    def process_group_for(self, x: torch.Tensor) -> ProcessGroup:
        """The torch group that can carry ``x``: CPU tensors go over gloo."""
        return self.cpu_group if x.device.type == "cpu" else self.device_group

    # -- collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group and return the result.

        The result is ``x`` itself, reduced in place, on every path today (and ``x`` unchanged
        for one rank); always use the return value, since an out-of-place path may return a new
        tensor. Symmetric-memory inputs in a winning size take NCCL's symmetric kernels (see
        ``all_reduce_dispatch``)."""
        return all_reduce_dispatch.all_reduce(self, x)

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, in group
        rank order. Returns a new tensor (``x`` itself for one rank)."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim() if x.dim() else 0
        x = x.contiguous()
        group = self.process_group_for(x)
        if x.device.type == "cuda":
            stacked = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(stacked, x, group=group)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=group)
            stacked = torch.stack(parts)
        if x.dim() == 0:
            return stacked
        out_shape = (*x.shape[:dim], self.world_size * x.shape[dim], *x.shape[dim + 1 :])
        return stacked.movedim(0, dim).reshape(out_shape)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy group rank ``src``'s ``x`` into every rank's ``x`` (in place); returns ``x``."""
        if self.world_size > 1:
            dist.broadcast(x, src=self.ranks[src], group=self.process_group_for(x))
        return x

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        payload = [obj]
        dist.broadcast_object_list(payload, src=self.ranks[src], group=self.cpu_group)
        return payload[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on group rank ``dst`` (in group rank order); None elsewhere."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank_in_group == dst else None
        dist.gather_object(obj, out, dst=self.ranks[dst], group=self.cpu_group)
        return out

    def barrier(self) -> None:
        """A CPU barrier over gloo (never enqueues GPU work)."""
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    # -- teardown

    def destroy(self) -> None:
        """Deregister windows, close pynccl, destroy the torch groups. Call on all ranks."""
        if self.pynccl_comm is not None:
            release_symmetric_windows(self)
            self.pynccl_comm.close()
            self.pynccl_comm = None
        if dist.is_initialized():
            groups = {id(g): g for g in (self.device_group, self.cpu_group) if g is not None}
            for group in groups.values():
                dist.destroy_process_group(group)
        self.device_group = None  # type: ignore[assignment]
        self.cpu_group = None  # type: ignore[assignment]


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_ATTN_TP: GroupCoordinator | None = None  # the TP group itself without DP attention
_ATTN_DP_SIZE = 1
# How long a collective of the groups built here waits for a peer (None: torch's default).
_group_timeout: timedelta | None = None


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed_environment(
    world_size: int = 1,
    rank: int = 0,
    *,
    backend: str | None = None,
    init_method: str | None = None,
    local_rank: int = -1,
    timeout: timedelta | None = None,
    group_timeout: timedelta | None = None,
) -> GroupCoordinator:
    """Start torch.distributed (if not started) and build the world group.

    ``timeout`` bounds the rendezvous (every rank must join within it); ``group_timeout``, when
    given, is how long a collective of the groups built afterwards waits for a peer (``timeout``
    otherwise), so a short join bound need not cut a long first-use compilation short.

    ``backend`` None means nccl when CUDA is available, else gloo. ``init_method`` None means
    ``env://`` (MASTER_ADDR/MASTER_PORT), except for a single process, which gets a free local
    TCP port. ``local_rank`` -1 means ``rank`` (one node). With nccl the process's current CUDA
    device becomes ``cuda:local_rank``."""
    global _WORLD, _group_timeout
    backend = backend or default_backend()
    _group_timeout = group_timeout if group_timeout is not None else timeout
    if local_rank < 0:
        local_rank = rank
    if not dist.is_initialized():
        if init_method is None:
            init_method = f"tcp://127.0.0.1:{find_free_port()}" if world_size == 1 else "env://"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = timeout
        dist.init_process_group(
            backend=backend, init_method=init_method, world_size=world_size, rank=rank, **kwargs
        )
    elif dist.get_world_size() != world_size:
        raise RuntimeError(
            f"torch.distributed already runs with world size {dist.get_world_size()}, "
            f"not {world_size}"
        )
    if _WORLD is None:
        _WORLD = GroupCoordinator(
            [list(range(dist.get_world_size()))], local_rank, backend, group_name="world"
        )
    return _WORLD


def get_world_group() -> GroupCoordinator:
    if _WORLD is None:
        raise RuntimeError(
            "the world group is not initialized; call init_distributed_environment()"
        )
    return _WORLD


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    *,
    use_pynccl: bool | None = None,
    attention_dp_size: int = 1,
) -> GroupCoordinator:
    """Split the world into consecutive TP groups of ``tensor_model_parallel_size`` ranks, and
    each TP group into ``attention_dp_size`` consecutive attention-TP groups (DP attention).

    ``use_pynccl`` None: on when symmetric memory is enabled, the backend is nccl and the
    group has more than one rank. True forces a communicator (even a one-rank one)."""
    global _TP, _ATTN_TP, _ATTN_DP_SIZE
    world = get_world_group()
    size = tensor_model_parallel_size
    total = dist.get_world_size()
    if size < 1 or total % size:
        raise ValueError(f"world size {total} is not divisible by TP size {size}")
    if attention_dp_size < 1 or size % attention_dp_size:
        raise ValueError(f"TP size {size} is not divisible by DP size {attention_dp_size}")
    if _TP is not None:
        if _TP.world_size != size or _ATTN_DP_SIZE != attention_dp_size:
            raise RuntimeError(
                f"model parallel is already initialized with TP={_TP.world_size}, "
                f"DP={_ATTN_DP_SIZE}, not TP={size}, DP={attention_dp_size}"
            )
        return _TP
    if use_pynccl is None:
        use_pynccl = is_symmetric_memory_enabled() and world.backend == "nccl" and size > 1
    groups = [list(range(i, i + size)) for i in range(0, total, size)]
    _TP = GroupCoordinator(
        groups, world.local_rank, world.backend, use_pynccl=use_pynccl, group_name="tp"
    )
    _ATTN_DP_SIZE = attention_dp_size
    if attention_dp_size == 1:
        _ATTN_TP = _TP
    else:
        attn = size // attention_dp_size
        attn_groups = [list(range(i, i + attn)) for i in range(0, total, attn)]
        _ATTN_TP = GroupCoordinator(
            attn_groups, world.local_rank, world.backend, group_name="attn_tp"
        )
    return _TP


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_tp_group() -> GroupCoordinator:
    if _TP is None:
        raise RuntimeError(
            "the tensor-parallel group is not initialized; call init_distributed_environment() "
            "and initialize_model_parallel() first (or use get_tp_group_or_none())"
        )
    return _TP


def get_tp_group_or_none() -> GroupCoordinator | None:
    return _TP


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_attn_tp_group() -> GroupCoordinator:
    """The ranks that split this rank's attention: its DP group (the TP group without DP)."""
    if _ATTN_TP is None:
        raise RuntimeError("the attention-TP group is not initialized; initialize_model_parallel()")
    return _ATTN_TP


def get_attention_dp_size() -> int:
    return _ATTN_DP_SIZE


def get_attention_dp_rank() -> int:
    """Which DP attention group this rank belongs to (0 without DP attention)."""
    return get_tp_group().rank_in_group // get_attn_tp_group().world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """``get_tp_group().all_reduce(x)``: use the returned tensor."""
    return get_tp_group().all_reduce(x)


def attention_tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """``get_attn_tp_group().all_reduce(x)`` (the TP group itself without DP attention): use the
    returned tensor."""
    return get_attn_tp_group().all_reduce(x)


def destroy_model_parallel() -> None:
    """Tear down the TP group: its windows, its pynccl communicator, its torch groups."""
    global _TP, _ATTN_TP, _ATTN_DP_SIZE
    tp, _TP = _TP, None
    attn, _ATTN_TP, _ATTN_DP_SIZE = _ATTN_TP, None, 1
    if attn is not None and attn is not tp:
        attn.destroy()
    if tp is not None:
        tp.destroy()


def destroy_distributed_environment() -> None:
    """Tear down everything: model parallel, then the symmetric pool, then the world group and
    torch.distributed itself."""
    global _WORLD
    destroy_model_parallel()
    shutdown_symmetric_memory()
    world, _WORLD = _WORLD, None
    if world is not None:
        world.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
