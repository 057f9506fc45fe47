"""RMSNorm, with and without a learned weight.

DeepSeek V4 keeps every norm weight in fp32 (the checkpoint stores them so), so the product is
taken in fp32 and cast to the activation dtype once at the end; the statistics are always fp32.
"""

from __future__ import annotations

import torch
from torch import nn

# The maths lives with the kernels (their torch references use it too); layers import it from here.
from sglang.kernels.ops.layernorm.rms_norm import rms_norm, unweighted_rms_norm

__all__ = ["RMSNorm", "rms_norm", "unweighted_rms_norm"]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with an fp32 weight (loaded from the checkpoint)."""

    def __init__(self, size: int, eps: float, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.size = size
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(size, dtype=torch.float32, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.size}, eps={self.eps}"
