"""One MoE layer's routed experts as a checkpoint stores them (before any dequantisation): what the
expert reader produces and the MegaMoE weight builder consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.layers.moe.expert_weights import WeightFormat


@dataclass(frozen=True)
class CheckpointExperts:
    """One layer's experts as stored, stacked: ``w13 = [w1; w3]`` on rows, and their scales."""

    fmt: WeightFormat
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """The bytes of these tensors as stored (this rank's share of the checkpoint)."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.w13, self.w2, self.w13_scale, self.w2_scale)
            if t is not None
        )
