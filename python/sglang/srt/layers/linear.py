"""Dense linear layers: replicated, column-parallel (output rows split) and row-parallel
(input columns split, partial sums all-reduced).

Each weight parameter carries a ``weight_loader(param, full)`` that takes the *full* (unsharded)
checkpoint tensor, checks its shape and copies this rank's slice, so the model loader never needs
to know how a layer is sharded. FP8 checkpoints are dequantised before the loader sees them (see
``model_loader``); the GEMM here runs in the parameter dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import tensor_model_parallel_all_reduce


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the layer expects."""


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {parts}")
    return n // parts


def attach_loader(
    param: nn.Parameter, loader: Callable[[nn.Parameter, torch.Tensor], None]
) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def copy_checked(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy an unsharded tensor (any float dtype) into ``param`` after a shape check."""
    if tuple(full.shape) != tuple(param.shape):
        raise WeightShapeError(f"expected shape {tuple(param.shape)}, got {tuple(full.shape)}")
    with torch.no_grad():
        param.copy_(full.to(param.dtype))


def default_weight_loader(param: nn.Parameter, full: torch.Tensor) -> None:
    copy_checked(param, full)


class LinearBase(nn.Module):
    """``y = x @ W^T`` with ``W`` of shape ``[out_local, in_local]`` in ``params_dtype``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        in_local: int,
        out_local: int,
        params_dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.in_local, self.out_local = in_local, out_local
        weight = nn.Parameter(
            torch.empty(out_local, in_local, dtype=params_dtype, device=device), requires_grad=False
        )
        self.weight = attach_loader(weight, self._load)

    @property
    def full_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def _check_full(self, full: torch.Tensor) -> None:
        if tuple(full.shape) != self.full_shape:
            raise WeightShapeError(f"expected shape {self.full_shape}, got {tuple(full.shape)}")

    def _shard(self, full: torch.Tensor) -> torch.Tensor:
        return full

    def _load(self, param: nn.Parameter, full: torch.Tensor) -> None:
        self._check_full(full)
        with torch.no_grad():
            param.copy_(self._shard(full).to(param.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local=({self.out_local}, {self.in_local})"


class ReplicatedLinear(LinearBase):
    """Full weight on every rank."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        params_dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            in_features, out_features, in_local=in_features, out_local=out_features,
            params_dtype=params_dtype, device=device,
        )  # fmt: skip


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays split (no communication)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        params_dtype: torch.dtype,
        tp_rank: int = 0,
        tp_size: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        out_local = _divide(out_features, tp_size, "output features")
        super().__init__(
            in_features, out_features, in_local=in_features, out_local=out_local,
            params_dtype=params_dtype, device=device,
        )  # fmt: skip
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def _shard(self, full: torch.Tensor) -> torch.Tensor:
        lo = self.tp_rank * self.out_local
        return full[lo : lo + self.out_local]


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial products are summed over the TP group
    unless ``reduce_results`` is False (the caller then owes the all-reduce)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        params_dtype: torch.dtype,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce_results: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        in_local = _divide(in_features, tp_size, "input features")
        super().__init__(
            in_features, out_features, in_local=in_local, out_local=out_features,
            params_dtype=params_dtype, device=device,
        )  # fmt: skip
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.reduce_results = reduce_results

    def _shard(self, full: torch.Tensor) -> torch.Tensor:
        lo = self.tp_rank * self.in_local
        return full[:, lo : lo + self.in_local]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce_results and self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        return y
