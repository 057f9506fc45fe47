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

from sglang.srt.distributed.parallel_state import (
    attention_tp_all_reduce,
    tensor_model_parallel_all_reduce,
)
from sglang.srt.layers.build_spec import LayerBuildSpec


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the layer expects."""


def per_rank(n: int, tp_size: int, what: str) -> int:
    """This rank's share of ``n`` things (heads, output groups, features) split evenly over the
    tensor-parallel group; heads and features never straddle ranks, so an uneven split is a
    configuration error. The message names the rank count ("over N ranks") so a failed start says
    which setting to change."""
    if n % tp_size:
        raise ValueError(
            f"{n} {what} do not split evenly over {tp_size} ranks (the tensor-parallel size)"
        )
    return n // tp_size


def tp_slice(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s contiguous ``1/tp_size`` of ``full`` along ``dim`` (a view)."""
    part = full.shape[dim] // tp_size
    return full.narrow(dim, tp_rank * part, part)


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


def frozen_param(
    data: torch.Tensor,
    loader: Callable[[nn.Parameter, torch.Tensor], None] = default_weight_loader,
) -> nn.Parameter:
    """``data`` as an inference-only parameter that the model loader fills through ``loader``
    (by default: the full tensor, shape-checked)."""
    return attach_loader(nn.Parameter(data, requires_grad=False), loader)


def fp32_param(*shape: int, device: torch.device | str | None) -> nn.Parameter:
    """A replicated fp32 parameter (zeros until loaded): the checkpoint ships these tensors in
    fp32 (router biases, mHC mixers, position biases) and they stay so."""
    return frozen_param(torch.zeros(*shape, dtype=torch.float32, device=device))


def dim0_sharded_param(full_shape: tuple[int, ...], spec: LayerBuildSpec) -> nn.Parameter:
    """An fp32 parameter holding this rank's ``1/tp`` of dim 0 (per-head vectors such as
    attention sinks, conv weights, ``dt_bias``); the loader takes the full tensor."""
    tp_rank, tp_size = spec.tp_rank, spec.tp_size
    if full_shape[0] % tp_size:
        raise ValueError(
            f"dim 0 of {full_shape} is not divisible by the tensor-parallel size {tp_size}"
        )
    local = (full_shape[0] // tp_size, *full_shape[1:])

    def load(param: nn.Parameter, full: torch.Tensor) -> None:
        if tuple(full.shape) != full_shape:
            raise WeightShapeError(f"expected shape {full_shape}, got {tuple(full.shape)}")
        with torch.no_grad():
            param.copy_(tp_slice(full, 0, tp_rank, tp_size).to(param.dtype))

    return frozen_param(torch.zeros(local, dtype=torch.float32, device=spec.device), load)


class LinearBase(nn.Module):
    """``y = x @ W^T`` with ``W`` of shape ``[out_local, in_local]`` in ``spec.dtype``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        spec: LayerBuildSpec,
        *,
        in_local: int,
        out_local: int,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.in_local, self.out_local = in_local, out_local
        weight = torch.empty(out_local, in_local, dtype=spec.dtype, device=spec.device)
        self.weight = frozen_param(weight, self._load)

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
        local = f"({self.out_local}, {self.in_local})"
        return f"in={self.in_features}, out={self.out_features}, local={local}"


class ReplicatedLinear(LinearBase):
    """Full weight on every rank (the spec's tensor-parallel place is ignored)."""

    def __init__(self, in_features: int, out_features: int, spec: LayerBuildSpec) -> None:
        super().__init__(
            in_features, out_features, spec, in_local=in_features, out_local=out_features
        )


class _TensorParallelLinear(LinearBase):
    """A linear layer whose weight is split across ranks along ``split_dim`` of ``[out, in]``:
    0 splits the output features, 1 the input features."""

    split_dim: int

    def __init__(self, in_features: int, out_features: int, spec: LayerBuildSpec) -> None:
        in_local, out_local = in_features, out_features
        if self.split_dim == 0:
            out_local = per_rank(out_features, spec.tp_size, "output features")
        else:
            in_local = per_rank(in_features, spec.tp_size, "input features")
        super().__init__(in_features, out_features, spec, in_local=in_local, out_local=out_local)
        self.tp_rank, self.tp_size = spec.tp_rank, spec.tp_size

    def _shard(self, full: torch.Tensor) -> torch.Tensor:
        return tp_slice(full, self.split_dim, self.tp_rank, self.tp_size)


class ColumnParallelLinear(_TensorParallelLinear):
    """Output features split across ranks; the output stays split (no communication)."""

    split_dim = 0


class RowParallelLinear(_TensorParallelLinear):
    """Input features split across ranks; the partial products are summed over the spec's group
    (the TP group, or the attention-TP group for attention under DP attention) unless
    ``reduce_results`` is False (the caller then owes the all-reduce)."""

    split_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        spec: LayerBuildSpec,
        *,
        reduce_results: bool = True,
    ) -> None:
        super().__init__(in_features, out_features, spec)
        self.reduce_results = reduce_results
        self.tp_group = spec.tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce_results and self.tp_size > 1:
            if self.tp_group == "attn_tp":
                y = attention_tp_all_reduce(y)
            else:
                y = tensor_model_parallel_all_reduce(y)
        return y
