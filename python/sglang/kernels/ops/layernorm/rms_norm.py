"""RMSNorm maths (no module, no weights of its own): the one definition that the layers' RMSNorm
and the kernels' torch references share."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim in fp32, cast to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm as V4 applies it per query head: the fp32 factor is cast to x's dtype
    *before* the multiply, so a bf16 input is scaled in bf16 (that is the reference rounding)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
