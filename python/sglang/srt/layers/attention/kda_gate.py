"""KDA's per-token scalars and vectors: the per-channel forget gate (log decay), beta and the q/k
L2 normalisation. All maths in fp32: the decay is exponentiated and cumulated over thousands of
tokens, so bf16 rounding here would compound.

Forget gate, for the pre-activation ``a = f_b(f_a(x)) + dt_bias`` viewed ``[..., H, D]``:
- safe form (Kimi K3, ``lower_bound`` lb < 0): ``g = lb * sigmoid(exp(A_log[h]) * a)`` in (lb, 0),
  so one token never decays the state by more than ``exp(lb)`` per channel;
- plain form (``lower_bound=None``, Kimi Linear): ``g = -exp(A_log[h]) * softplus(a)``, softplus
  taken as the identity above 20 (where it equals its argument to fp32 precision).
"""

from __future__ import annotations

import torch
from torch import Tensor

# The eps sits inside the sqrt (not a max(norm, eps) floor), as in the reference kernels.
L2NORM_EPS = 1e-6
_SOFTPLUS_THRESHOLD = 20.0


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in fp32."""
    xf = x.float()
    return xf / torch.sqrt(xf.square().sum(-1, keepdim=True) + eps)


def kda_forget_gate(a: Tensor, a_log: Tensor, lower_bound: float | None) -> Tensor:
    """Log decay ``g [..., H, D]`` (fp32) from the gate pre-activation ``a [..., H, D]`` and the
    per-head ``A_log [H]``."""
    if a.dim() < 2 or a_log.shape != (a.shape[-2],):
        raise ValueError(
            f"A_log {tuple(a_log.shape)} must be [H] for a gate input {tuple(a.shape)}"
        )
    rate = torch.exp(a_log.float()).unsqueeze(-1)  # [H, 1], broadcast over the head's channels
    af = a.float()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * af)
    softplus = torch.where(af > _SOFTPLUS_THRESHOLD, af, torch.log1p(torch.exp(af)))
    return -rate * softplus


def kda_beta(b_logits: Tensor) -> Tensor:
    """Per-head write strength ``beta = sigmoid(b_proj(x))`` in fp32."""
    return torch.sigmoid(b_logits.float())
