"""Routed-expert weights in the layout every MoE runner takes, from any checkpoint format.

Runtime layout (per rank, after tensor-parallel sharding of the intermediate dimension):
- ``w13``: ``[E, 2I, H]``, rows ``[0, I)`` the gate projection, rows ``[I, 2I)`` the up projection;
- ``w2``:  ``[E, H, I]``;
- bf16, or FP8 e4m3 with one fp32 scale per 128x128 block (``w13_scale [E, 2I/128, H/128]``,
  ``w2_scale [E, H/128, I/128]``).

Checkpoints come as bf16, FP8 128x128-block or MXFP4 (dequantised to bf16 at load: Hopper has no
FP4 matrix instructions, and converting once is cheaper than every step).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from sglang.kernels.ops.quant.fp8 import block_dequant_fp8
from sglang.srt.layers.quantization.mxfp4 import dequant_mxfp4

FP8_BLOCK = (128, 128)


class WeightFormat(str, enum.Enum):
    BF16 = "bf16"
    FP8 = "fp8"
    MXFP4 = "mxfp4"


@dataclass
class ExpertWeights:
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        e, two_i, h = self.w13.shape
        if self.w2.shape != (e, h, two_i // 2) or two_i % 2:
            raise ValueError(
                f"expert weights disagree: w13 {tuple(self.w13.shape)} needs w2 "
                f"{(e, h, two_i // 2)}, "
                f"got {tuple(self.w2.shape)}"
            )
        if self.is_fp8:
            for name, w, s in (("w13", self.w13, self.w13_scale), ("w2", self.w2, self.w2_scale)):
                want = (w.shape[0], -(-w.shape[1] // FP8_BLOCK[0]), -(-w.shape[2] // FP8_BLOCK[1]))
                if s is None or tuple(s.shape) != want:
                    got = None if s is None else tuple(s.shape)
                    raise ValueError(
                        f"FP8 {name} of shape {tuple(w.shape)} needs block scales {want}, got {got}"
                    )

    @property
    def is_fp8(self) -> bool:
        return self.w13.dtype == torch.float8_e4m3fn

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]

    @property
    def block_shape(self) -> tuple[int, int] | None:
        return FP8_BLOCK if self.is_fp8 else None

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in ``dtype``: the reference view of whatever is stored."""
        if not self.is_fp8:
            return self.w13.to(dtype), self.w2.to(dtype)
        assert self.w13_scale is not None and self.w2_scale is not None
        return (
            block_dequant_fp8(self.w13, self.w13_scale, FP8_BLOCK).to(dtype),
            block_dequant_fp8(self.w2, self.w2_scale, FP8_BLOCK).to(dtype),
        )

    def shard(self, tp_rank: int, tp_size: int) -> ExpertWeights:
        """This rank's slice of the intermediate dimension (gate and up sliced alike)."""
        if tp_size == 1:
            return self
        inter = self.intermediate_size
        if inter % tp_size:
            raise ValueError(f"intermediate size {inter} is not divisible by tp size {tp_size}")
        part = inter // tp_size
        if self.is_fp8 and part % FP8_BLOCK[0]:
            raise ValueError(
                f"FP8 experts need intermediate/tp ({inter}/{tp_size}={part}) divisible by "
                f"{FP8_BLOCK[0]}"
            )
        lo, hi = tp_rank * part, (tp_rank + 1) * part
        w13 = torch.cat([self.w13[:, lo:hi], self.w13[:, inter + lo : inter + hi]], dim=1)
        w2 = self.w2[:, :, lo:hi]
        if not self.is_fp8:
            return ExpertWeights(w13.contiguous(), w2.contiguous())
        assert self.w13_scale is not None and self.w2_scale is not None
        b = FP8_BLOCK[0]
        nb, ib = inter // b, (lo // b, hi // b)
        s13 = torch.cat(
            [self.w13_scale[:, ib[0] : ib[1]], self.w13_scale[:, nb + ib[0] : nb + ib[1]]], dim=1
        )
        s2 = self.w2_scale[:, :, ib[0] : ib[1]]
        return ExpertWeights(w13.contiguous(), w2.contiguous(), s13.contiguous(), s2.contiguous())


def expert_weights_from_checkpoint(
    fmt: WeightFormat | str,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> ExpertWeights:
    """Build runtime weights from stacked checkpoint tensors.

    - bf16: ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` in any float dtype (cast to ``dtype``);
    - fp8: e4m3 tensors of the same shapes with 128x128 block scales (kept FP8);
    - mxfp4: packed uint8 ``w13 [E, 2I, H/2]``, ``w2 [E, H, I/2]`` with UE8M0 scales
      ``[E, 2I, H/32]`` / ``[E, H, I/32]`` (dequantised to ``dtype``)."""
    fmt = WeightFormat(fmt)
    if fmt is WeightFormat.BF16:
        return ExpertWeights(w13.to(dtype), w2.to(dtype))
    if fmt is WeightFormat.FP8:
        if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
            raise TypeError(f"FP8 experts must be float8_e4m3fn, got {w13.dtype} and {w2.dtype}")
        return ExpertWeights(
            w13,
            w2,
            w13_scale.float() if w13_scale is not None else None,
            w2_scale.float() if w2_scale is not None else None,
        )
    if w13_scale is None or w2_scale is None:
        raise ValueError("MXFP4 experts need their UE8M0 scales (w13_scale and w2_scale)")
    return ExpertWeights(dequant_mxfp4(w13, w13_scale, dtype), dequant_mxfp4(w2, w2_scale, dtype))


def stack_expert_tensors(
    gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert checkpoint tensors (w1=gate [I, H], w3=up [I, H], w2=down [H, I]) -> stacked
    ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (works for packed and scale tensors alike)."""
    if not (len(gate) == len(up) == len(down)) or not gate:
        raise ValueError(
            "need the same non-zero number of gate/up/down tensors, got "
            f"{len(gate)}/{len(up)}/{len(down)}"
        )
    return torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up)]), torch.stack(down)
