"""The KDA delta rule in chunks (the prefill form): the same maths as ``kda_recurrent``, with the
sequential work reduced to one small triangular solve per chunk.

Within a chunk of ``n <= C`` tokens (G = the in-chunk cumulative sum of the log decay, per key
channel; ``S`` the incoming state as ``[K, V]``):
  A[i, j] = beta_i * sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])     (i > j; 0 elsewhere)
  (I + A) U = diag(beta) V ;   (I + A) W = diag(beta) (K * exp(G))
  V' = U - W S                                                     (the delta-rule values)
  O  = (Q * exp(G)) S + M V',  M[i, j] = sum_c q_i[c] k_j[c] exp(G_i[c] - G_j[c])   (j <= i)
  S' = exp(G_last) * S + (K * exp(G_last - G))^T V'
Only differences ``G_i - G_j`` with ``j <= i`` (all <= 0) and ``G`` itself (<= 0) are ever
exponentiated, so nothing overflows however strong the decay; the pairwise factor is formed
explicitly (``[H, n, n, K]`` per chunk) instead of as ``exp(G_i) * exp(-G_j)``, whose second
factor overflows fp32 once a chunk decays by more than ~88 nats (the safe gate allows 5 a token).
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK_SIZE = 64


def kda_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """One sequence: ``q, k, g [T, H, K]``, ``v [T, H, V]``, ``beta [T, H]``, ``state [H, V, K]``
    (V-major, as stored). q L2-normalised and scaled, k L2-normalised.

    Returns ``(o [T, H, V], final state [H, V, K])`` in fp32; ``state`` is not modified."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    if state.shape != (h, dv, dk):
        raise ValueError(f"KDA state {tuple(state.shape)} does not match {(h, dv, dk)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    # Heads first: every chunk op below is a batched matmul over heads.
    qf, kf, gf = (x.float().transpose(0, 1) for x in (q, k, g))  # [H, T, K]
    vf = v.float().transpose(0, 1)  # [H, T, V]
    bf = beta.float().transpose(0, 1).unsqueeze(-1)  # [H, T, 1]
    s = state.float().transpose(-1, -2).contiguous()  # [H, K, V]
    out = torch.empty(h, t, dv, dtype=torch.float32, device=v.device)
    for lo in range(0, t, chunk_size):
        hi = min(lo + chunk_size, t)
        out[:, lo:hi], s = _chunk_step(
            qf[:, lo:hi], kf[:, lo:hi], vf[:, lo:hi], gf[:, lo:hi], bf[:, lo:hi], s
        )
    return out.transpose(0, 1), s.transpose(-1, -2).contiguous()


def _chunk_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor
) -> tuple[Tensor, Tensor]:
    """One chunk, heads batched: ``q, k, g [H, n, K]``, ``v [H, n, V]``, ``beta [H, n, 1]``,
    ``s [H, K, V]`` -> ``(o [H, n, V], s')``."""
    n = k.shape[1]
    cum = g.cumsum(dim=1)  # G
    idx = torch.arange(n, device=k.device)
    causal = idx.unsqueeze(1) >= idx.unsqueeze(0)  # j <= i
    diff = cum.unsqueeze(2) - cum.unsqueeze(1)  # [H, i, j, K] = G_i - G_j
    pair = torch.exp(diff.masked_fill(~causal.unsqueeze(-1), float("-inf")))
    qk = torch.einsum("hic,hjc,hijc->hij", q, k, pair)  # M (inclusive)
    kk = torch.einsum("hic,hjc,hijc->hij", k, k, pair)
    strict = idx.unsqueeze(1) > idx.unsqueeze(0)
    lower = (beta * kk).masked_fill(~strict, 0.0)
    eye = torch.eye(n, dtype=lower.dtype, device=lower.device)
    system = lower + eye  # unit lower triangular
    decay = torch.exp(cum)
    rhs = torch.cat([beta * v, beta * (k * decay)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    v_new = u - w @ s
    o = (q * decay) @ s + qk @ v_new
    last = cum[:, -1:, :]  # [H, 1, K]
    s_next = (
        s * torch.exp(last).transpose(-1, -2)
        + (k * torch.exp(last - cum)).transpose(-1, -2) @ v_new
    )
    return o, s_next
