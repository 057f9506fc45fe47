"""A ctypes NCCL communicator beside torch's c10d one.

Why our own: NCCL windows (symmetric memory) are registered per communicator, and c10d does not
expose its ``ncclComm_t`` to Python. This communicator owns one, so the symmetric pool can
register windows on it and the all-reduce that must see those windows runs on it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from sglang.srt.distributed.device_communicators.pynccl_library import (
    NCCL_WIN_COLL_SYMMETRIC,
    NcclDataType,
    NcclLibrary,
    NcclRedOp,
    NcclUniqueId,
    get_nccl_library,
)
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

_DTYPES: dict[torch.dtype, NcclDataType] = {
    torch.int8: NcclDataType.INT8,
    torch.uint8: NcclDataType.UINT8,
    torch.int32: NcclDataType.INT32,
    torch.int64: NcclDataType.INT64,
    torch.float16: NcclDataType.FLOAT16,
    torch.float32: NcclDataType.FLOAT32,
    torch.float64: NcclDataType.FLOAT64,
    torch.bfloat16: NcclDataType.BFLOAT16,
}
for _name, _code in (
    ("float8_e4m3fn", NcclDataType.FLOAT8_E4M3),
    ("float8_e5m2", NcclDataType.FLOAT8_E5M2),
):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


def nccl_dtype(dtype: torch.dtype) -> NcclDataType:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError(f"NCCL has no data type for {dtype}") from None


def nccl_op(op: NcclRedOp | dist.ReduceOp) -> NcclRedOp:
    if isinstance(op, NcclRedOp):
        return op
    for torch_op, ours in (
        (dist.ReduceOp.SUM, NcclRedOp.SUM),
        (dist.ReduceOp.PRODUCT, NcclRedOp.PROD),
        (dist.ReduceOp.MAX, NcclRedOp.MAX),
        (dist.ReduceOp.MIN, NcclRedOp.MIN),
        (dist.ReduceOp.AVG, NcclRedOp.AVG),
    ):
        if op == torch_op:
            return ours
    raise ValueError(f"unsupported reduce op {op}")


class PyNcclCommunicator:
    """An NCCL communicator over the ranks of ``group`` (a gloo/CPU group, used once to
    broadcast the unique id), bound to ``device``. Every rank of ``group`` must construct it."""

    def __init__(
        self,
        group: ProcessGroup,
        device: int | str | torch.device,
        library: NcclLibrary | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("PyNcclCommunicator needs torch.distributed to be initialized")
        self.lib = library if library is not None else get_nccl_library()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        device = (
            torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        )
        if device.type != "cuda":
            raise ValueError(f"PyNcclCommunicator needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

        uid = self.lib.get_unique_id() if self.rank == 0 else NcclUniqueId()
        payload: list[object] = [uid.to_bytes()]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        uid = NcclUniqueId.from_bytes(payload[0])  # type: ignore[arg-type]
        with torch.cuda.device(self.device):
            self._comm: int | None = self.lib.comm_init_rank(self.world_size, uid, self.rank)
            # One tiny all-reduce surfaces transport problems here rather than mid-forward.
            probe = torch.zeros(1, device=self.device)
            self.all_reduce(probe)
            torch.cuda.current_stream(self.device).synchronize()
        logger.debug(
            "pynccl communicator rank %d/%d on %s", self.rank, self.world_size, self.device
        )

    @property
    def comm(self) -> int:
        if self._comm is None:
            raise RuntimeError("the NCCL communicator was closed")
        return self._comm

    @property
    def closed(self) -> bool:
        return self._comm is None

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: NcclRedOp | dist.ReduceOp = NcclRedOp.SUM,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Reduce ``tensor`` across the ranks IN PLACE on ``stream`` (default: current stream).

        If ``tensor`` lies in windows registered with NCCL_WIN_COLL_SYMMETRIC on this
        communicator, NCCL picks its symmetric kernels; otherwise its regular ones."""
        if tensor.device != self.device:
            raise ValueError(f"tensor on {tensor.device}, communicator on {self.device}")
        if not tensor.is_contiguous():
            raise ValueError("pynccl all_reduce needs a contiguous tensor")
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        ptr = tensor.data_ptr()
        self.lib.all_reduce(
            ptr,
            ptr,
            tensor.numel(),
            int(nccl_dtype(tensor.dtype)),
            int(nccl_op(op)),
            self.comm,
            int(stream.cuda_stream),
        )

    def register_window(self, ptr: int, size: int, flags: int = NCCL_WIN_COLL_SYMMETRIC) -> int:
        """Register ``[ptr, ptr + size)`` (cuMem memory, e.g. from ncclMemAlloc) as a window.

        Collective and blocking: every rank must call it with the same size, in the same order.
        Not allowed while a CUDA graph is capturing."""
        with torch.cuda.device(self.device):
            return self.lib.comm_window_register(self.comm, ptr, size, flags)

    def deregister_window(self, handle: int) -> None:
        with torch.cuda.device(self.device):
            self.lib.comm_window_deregister(self.comm, handle)

    def close(self) -> None:
        """Destroy the communicator; deregister its windows first."""
        if self._comm is None:
            return
        comm, self._comm = self._comm, None
        with torch.cuda.device(self.device):
            self.lib.comm_destroy(comm)
