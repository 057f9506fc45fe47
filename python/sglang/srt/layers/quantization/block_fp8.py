"""A block-FP8 dense weight as a checkpoint ships it: e4m3 ``[N, K]`` plus one scale per 128 x 128
tile ``[ceil(N/128), ceil(K/128)]`` (UE8M0 ``float8_e8m0fnu`` in DeepSeek's release, fp32 as
``weight_scale_inv`` in other exports, or raw UE8M0 bytes). The model loader hands the pair to the
layer's weight loader as one value, and the layer keeps it FP8 or dequantises it.

Tensor-parallel slices keep whole scale blocks: a column-parallel rank's rows, or a row-parallel
rank's columns, must be a multiple of 128 (unless there is one rank), else the slice is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.kernels.ops.quant.fp8 import FP8_DTYPE, block_dequant_fp8
from sglang.srt.layers.quantization.dense_quant import FP8_BLOCK
from sglang.srt.layers.quantization.mxfp4 import ue8m0_to_float

# Dtypes a checkpoint's FP8 block scale may have: UE8M0 as float8_e8m0fnu or raw bytes, or float.
_SCALE_DTYPES = (
    torch.float8_e8m0fnu,
    torch.uint8,
    torch.float32,
    torch.bfloat16,
    torch.float16,
)


class WeightFormatError(ValueError):
    """A checkpoint tensor's format (dtype, scales) does not fit the layer that loads it."""


@dataclass(frozen=True)
class BlockFp8Weight:
    """``weight`` e4m3 ``[N, K]`` and its block ``scale`` ``[ceil(N/128), ceil(K/128)]``."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 2:
            raise WeightFormatError(
                f"a block-FP8 weight is a 2-D {FP8_DTYPE}, got {self.weight.dtype} "
                f"{tuple(self.weight.shape)}"
            )
        if self.scale.dtype not in _SCALE_DTYPES:
            raise WeightFormatError(
                f"FP8 block scales must be UE8M0 or float, got {self.scale.dtype}"
            )
        n, k = self.weight.shape
        want = (-(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1]))
        if tuple(self.scale.shape) != want:
            raise WeightFormatError(
                f"block scale {tuple(self.scale.shape)} does not fit weight {(n, k)} with "
                f"{FP8_BLOCK[0]}x{FP8_BLOCK[1]} blocks (expected {want})"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.weight.shape[0]), int(self.weight.shape[1]))

    def scale_fp32(self) -> torch.Tensor:
        """The scales as fp32 powers of two (or whatever float values they hold)."""
        if self.scale.dtype == torch.uint8:  # raw UE8M0 exponent bytes
            return ue8m0_to_float(self.scale)
        return self.scale.to(torch.float32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``weight * scale`` per tile (in fp32), as ``dtype``."""
        return block_dequant_fp8(self.weight, self.scale_fp32(), FP8_BLOCK, dtype=dtype)

    def shard(self, dim: int, rank: int, size: int) -> BlockFp8Weight:
        """Rank ``rank``'s ``1/size`` of the weight along ``dim`` (0: rows, 1: columns) and the
        scale blocks that cover it. A slice that does not start and end on a block boundary is
        refused, naming the split (the loader adds the tensor's name)."""
        if size == 1:
            return self
        full = self.weight.shape[dim]
        part = full // size
        block = FP8_BLOCK[dim]
        if full % size or part % block:
            what = "rows (column-parallel)" if dim == 0 else "columns (row-parallel)"
            raise WeightFormatError(
                f"splitting its {full} {what} over tensor-parallel size {size} gives "
                f"{full / size:g} a rank, which breaks its {block}-wide FP8 scale blocks; use a "
                f"tensor-parallel size that leaves each rank a multiple of {block}"
            )
        blocks = part // block
        return BlockFp8Weight(
            self.weight.narrow(dim, rank * part, part),
            self.scale.narrow(dim, rank * blocks, blocks),
        )
