"""Dense linear layers: replicated, column-parallel (output rows split), row-parallel (input
columns split, partial sums all-reduced) and grouped (block-diagonal, DeepSeek V4's ``wo_a``).

Each weight parameter carries a ``weight_loader(param, full)`` that takes the *full* (unsharded)
checkpoint tensor, checks its shape and copies this rank's slice, so the model loader never needs
to know how a layer is sharded.

Block-FP8 layers: a model builds a layer whose checkpoint weight ships FP8 (e4m3, one scale per
128 x 128 tile) from a spec with ``dense_quant`` set, and its loader then takes the weight and
its scale as one :class:`BlockFp8Weight`. With a bf16/fp16 model the weight stays e4m3 and its
fp32 scale sits beside it (buffer ``weight_scale_inv``), on every device; the forward quantises
the input per token per 128 values and runs the W8A8 GEMM (DeepGEMM or Triton on CUDA, the torch
reference of the same maths elsewhere: ``quantization/fp8_linear.py``). With an fp32 model (the
exactness-check mode) the weight is dequantised to fp32 at load. A float tensor for an FP8 layer,
or an FP8 one for a float layer, is refused, as is a tensor-parallel split that cuts a scale block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from sglang.kernels.ops.quant.fp8 import FP8_DTYPE
from sglang.srt.distributed.parallel_state import (
    attention_tp_all_reduce,
    tensor_model_parallel_all_reduce,
)
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.quantization.block_fp8 import BlockFp8Weight, WeightFormatError
from sglang.srt.layers.quantization.dense_quant import FP8_BLOCK
from sglang.srt.layers.quantization.fp8_linear import (
    Fp8Activation,
    fp8_grouped_linear,
    fp8_grouped_linear_quantized,
    fp8_linear,
    quantize_activation,
)
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)

# Model dtypes in which block-FP8 weights stay FP8 (W8A8); fp32 dequantises them at load.
FP8_RESIDENT_DTYPES = (torch.bfloat16, torch.float16)
# A layer's input: a float tensor, or one already quantised for its FP8 GEMM.
LinearInput = torch.Tensor | Fp8Activation

__all__ = [
    "BlockFp8Weight",
    "ColumnParallelLinear",
    "Fp8Activation",
    "GroupedColumnParallelLinear",
    "LinearInput",
    "ReplicatedLinear",
    "RowParallelLinear",
    "WeightFormatError",
    "WeightShapeError",
]


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


TensorT = TypeVar("TensorT", bound=torch.Tensor)


def attach_loader(param: TensorT, loader: Callable[[TensorT, torch.Tensor], None]) -> TensorT:
    """Give a parameter (or a buffer the checkpoint fills) the loader that takes its full
    checkpoint tensor."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def copy_checked(param: torch.Tensor, full: torch.Tensor | BlockFp8Weight) -> None:
    """Copy an unsharded tensor (any float dtype) into ``param`` after a shape check."""
    if isinstance(full, BlockFp8Weight):
        raise WeightFormatError("the checkpoint ships it block-FP8; this parameter takes floats")
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
    """``y = x @ W^T`` with ``W`` of shape ``[out_local, in_local]``: in ``spec.dtype``, or e4m3
    with its fp32 block scale when ``spec.dense_quant`` is set and the model runs bf16/fp16."""

    # The dim of ``[out, in]`` split across ranks: 0 output rows, 1 input columns, None (whole).
    split_dim: int | None = None

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
        self.tp_rank, self.tp_size = (
            (spec.tp_rank, spec.tp_size) if self.split_dim is not None else (0, 1)
        )
        self.dense_quant = spec.dense_quant
        self.out_dtype = spec.dtype
        # FP8 stays FP8 unless the model runs fp32 (the exactness check dequantises at load).
        self.fp8 = self.dense_quant is not None and spec.dtype in FP8_RESIDENT_DTYPES
        dtype = FP8_DTYPE if self.fp8 else spec.dtype
        weight = torch.empty(out_local, in_local, dtype=dtype, device=spec.device)
        self.weight = frozen_param(weight, self._load)
        scale = None
        if self.fp8:
            blocks = (-(-out_local // FP8_BLOCK[0]), -(-in_local // FP8_BLOCK[1]))
            scale = torch.empty(blocks, dtype=torch.float32, device=spec.device)
        self.register_buffer("weight_scale_inv", scale)

    @property
    def full_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def _check_full(self, full: torch.Tensor) -> None:
        if tuple(full.shape) != self.full_shape:
            raise WeightShapeError(f"expected shape {self.full_shape}, got {tuple(full.shape)}")

    def _shard(self, full: torch.Tensor) -> torch.Tensor:
        if self.split_dim is None:
            return full
        return tp_slice(full, self.split_dim, self.tp_rank, self.tp_size)

    def _load(self, param: nn.Parameter, full: torch.Tensor | BlockFp8Weight) -> None:
        if isinstance(full, BlockFp8Weight):
            self._load_fp8(param, full)
            return
        if self.dense_quant is not None:
            raise WeightFormatError(
                "the model's quantization config says this weight ships block-FP8 (e4m3 with "
                f"128x128 scales), but the checkpoint has a {full.dtype} tensor without scales"
            )
        self._check_full(full)
        with torch.no_grad():
            param.copy_(self._shard(full).to(param.dtype))

    def _load_fp8(self, param: nn.Parameter, full: BlockFp8Weight) -> None:
        if self.dense_quant is None:
            raise WeightFormatError(
                "the checkpoint ships this weight block-FP8, but the model builds the layer "
                "unquantised (its quantization config does not cover it)"
            )
        self._check_full(full.weight)
        with torch.no_grad():
            if not self.fp8:
                log_once(
                    logger,
                    logging.INFO,
                    f"block-FP8 dense weights are dequantised to {param.dtype} at load (the "
                    f"model runs {param.dtype}: the exactness-check mode)",
                )
                param.copy_(self._shard(full.dequantize(torch.float32)).to(param.dtype))
                return
            part = (
                full
                if self.split_dim is None
                else full.shard(self.split_dim, self.tp_rank, self.tp_size)
            )
            param.copy_(part.weight)
            self.weight_scale_inv.copy_(part.scale_fp32())

    def prepare_input(self, x: torch.Tensor) -> LinearInput:
        """``x [T, in]`` as this layer's GEMM reads it: quantised (per token per 128 values) for
        an FP8 layer, so layers that read the same input quantise it once; else ``x``."""
        return quantize_activation(x) if self.fp8 else x

    def _matmul(self, x: LinearInput) -> torch.Tensor:
        if self.fp8:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.out_dtype)
        if isinstance(x, Fp8Activation):
            raise TypeError("an FP8-quantised input reached a layer whose weight is not FP8")
        return F.linear(x, self.weight)

    def forward(self, x: LinearInput) -> torch.Tensor:
        return self._matmul(x)

    def extra_repr(self) -> str:
        local = f"({self.out_local}, {self.in_local})"
        fp8 = ", fp8 128x128" if self.fp8 else ""
        return f"in={self.in_features}, out={self.out_features}, local={local}{fp8}"


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


class ColumnParallelLinear(_TensorParallelLinear):
    """Output features split across ranks; the output stays split (no communication)."""

    split_dim = 0


class GroupedColumnParallelLinear(ColumnParallelLinear):
    """Block-diagonal: ``groups`` independent ``[out_per_group, in_per_group]`` blocks stacked on
    the weight's rows (``[groups * out_per_group, in_per_group]``, one checkpoint tensor), split by
    whole groups across ranks. ``x [T, local groups, in_per_group]`` -> ``[T, local groups *
    out_per_group]``: group ``g`` of the input times its own block (DeepSeek V4's ``wo_a``). An
    FP8 weight runs one grouped W8A8 launch over all groups."""

    def __init__(
        self, in_per_group: int, groups: int, out_per_group: int, spec: LayerBuildSpec
    ) -> None:
        local_groups = per_rank(groups, spec.tp_size, "output groups")
        super().__init__(in_per_group, groups * out_per_group, spec)
        self.local_groups, self.out_per_group = local_groups, out_per_group

    def forward(self, x: LinearInput) -> torch.Tensor:
        if self.fp8:
            return fp8_grouped_linear(x, self.weight, self.weight_scale_inv, self.out_dtype)
        if isinstance(x, Fp8Activation):
            raise TypeError("an FP8-quantised input reached a layer whose weight is not FP8")
        w = self.weight.view(self.local_groups, self.out_per_group, -1)
        return torch.einsum("tgd,grd->tgr", x, w).reshape(x.shape[0], -1)

    def forward_quantized(self, x: torch.Tensor) -> Fp8Activation:
        """:meth:`forward` of an FP8 layer with the output quantised for the next FP8 GEMM in
        the epilogue (``out_per_group`` a multiple of 128)."""
        if not self.fp8 or self.out_per_group % FP8_BLOCK[0]:
            raise ValueError(
                f"a quantised output needs an FP8 weight and groups of a multiple of "
                f"{FP8_BLOCK[0]} rows (fp8={self.fp8}, {self.out_per_group} rows a group)"
            )
        return fp8_grouped_linear_quantized(x, self.weight, self.weight_scale_inv, self.out_dtype)


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

    def forward(self, x: LinearInput) -> torch.Tensor:
        y = self._matmul(x)
        if self.reduce_results and self.tp_size > 1:
            if self.tp_group == "attn_tp":
                y = attention_tp_all_reduce(y)
            else:
                y = tensor_model_parallel_all_reduce(y)
        return y
