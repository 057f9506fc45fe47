"""The KDA delta rule, one token at a time: the decode form and the oracle for the chunked form.

Per batch row, head and token, with the state stored V-major (``S[v, k]``, as SGLang lays it out
so a kernel reads contiguous key channels):
  S <- S * exp(g_t)[None, :]          per-key-channel decay
  u  = beta_t * (v_t - S k_t)         what the state mispredicts for this key
  S <- S + u k_t^T                    delta-rule write
  o_t = S q_t
q must already be L2-normalised and scaled by K^-1/2, k L2-normalised. Everything is fp32, or
float64 when any input is (the float64 oracle of the prefill kernels' checks).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def kda_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """Run the recurrence over ``T`` tokens.

    Shapes: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``,
    ``state [B, H, V, K]``.
    Returns ``(o [B, T, H, V], final state [B, H, V, K])`` in fp32 (float64 if an input is);
    ``state`` is not modified."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    if state.shape != (b, h, dv, dk):
        raise ValueError(f"KDA state {tuple(state.shape)} does not match {(b, h, dv, dk)}")
    dt = functools.reduce(torch.promote_types, (x.dtype for x in (q, k, v, g, beta, state)))
    dt = torch.promote_types(dt, torch.float32)
    s = state.to(dt, copy=True)
    qf, kf, vf, bf = q.to(dt), k.to(dt), v.to(dt), beta.to(dt)
    decay = torch.exp(g.to(dt))
    out = torch.empty(b, t, h, dv, dtype=dt, device=v.device)
    for i in range(t):
        k_i = kf[:, i]
        s.mul_(decay[:, i].unsqueeze(-2))
        predicted = torch.einsum("bhvk,bhk->bhv", s, k_i)
        u = bf[:, i].unsqueeze(-1) * (vf[:, i] - predicted)
        s.add_(u.unsqueeze(-1) * k_i.unsqueeze(-2))
        out[:, i] = torch.einsum("bhvk,bhk->bhv", s, qf[:, i])
    return out, s
