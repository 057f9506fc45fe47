"""mHC's Sinkhorn normalisation on per-thread scalars (an experiment, not wired in: no faster).

The mHC finalize runs one program per token and normalises that token's ``4 x 4`` comb matrix
with ``tl.sum`` over rows and columns: 2 reductions per step, 20 steps, each a cross-lane
exchange on the token's serial path. Here a program takes ``BLOCK_T`` tokens and holds each
token's 16 entries as 16 separate ``[BLOCK_T]`` vectors, so every row and column sum is 3 adds in
the thread that owns the token: no exchanges, and all tokens of a block step together.

Maths (the torch reference, ``mhc._sinkhorn``): ``c = softmax(c, rows) + eps``; ``c /= colsum +
eps``; then ``iters - 1`` times ``c /= rowsum + eps``; ``c /= colsum + eps``. Same operations in
the same order per element as the reference, so fp32 results agree to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_norm(a, b, c, d, eps):
    s = a + b + c + d + eps
    return a / s, b / s, c / s, d / s


@triton.jit
def _row_softmax(a, b, c, d):
    mx = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    return _row_norm(tl.exp(a - mx), tl.exp(b - mx), tl.exp(c - mx), tl.exp(d - mx), 0.0)


@triton.jit
def _sinkhorn_scalar_kernel(c_ptr, out_ptr, T, hc_eps, iters, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    base = c_ptr + t.to(tl.int64) * 16
    # row r, column k -> m{r}{k}
    m00 = tl.load(base + 0, mask=ok, other=0.0)
    m01 = tl.load(base + 1, mask=ok, other=0.0)
    m02 = tl.load(base + 2, mask=ok, other=0.0)
    m03 = tl.load(base + 3, mask=ok, other=0.0)
    m10 = tl.load(base + 4, mask=ok, other=0.0)
    m11 = tl.load(base + 5, mask=ok, other=0.0)
    m12 = tl.load(base + 6, mask=ok, other=0.0)
    m13 = tl.load(base + 7, mask=ok, other=0.0)
    m20 = tl.load(base + 8, mask=ok, other=0.0)
    m21 = tl.load(base + 9, mask=ok, other=0.0)
    m22 = tl.load(base + 10, mask=ok, other=0.0)
    m23 = tl.load(base + 11, mask=ok, other=0.0)
    m30 = tl.load(base + 12, mask=ok, other=0.0)
    m31 = tl.load(base + 13, mask=ok, other=0.0)
    m32 = tl.load(base + 14, mask=ok, other=0.0)
    m33 = tl.load(base + 15, mask=ok, other=0.0)
    # row softmax, + eps
    m00, m01, m02, m03 = _row_softmax(m00, m01, m02, m03)
    m10, m11, m12, m13 = _row_softmax(m10, m11, m12, m13)
    m20, m21, m22, m23 = _row_softmax(m20, m21, m22, m23)
    m30, m31, m32, m33 = _row_softmax(m30, m31, m32, m33)
    m00, m01, m02, m03 = m00 + hc_eps, m01 + hc_eps, m02 + hc_eps, m03 + hc_eps
    m10, m11, m12, m13 = m10 + hc_eps, m11 + hc_eps, m12 + hc_eps, m13 + hc_eps
    m20, m21, m22, m23 = m20 + hc_eps, m21 + hc_eps, m22 + hc_eps, m23 + hc_eps
    m30, m31, m32, m33 = m30 + hc_eps, m31 + hc_eps, m32 + hc_eps, m33 + hc_eps
    # column normalisation (a column is a "row" of the transposed names)
    m00, m10, m20, m30 = _row_norm(m00, m10, m20, m30, hc_eps)
    m01, m11, m21, m31 = _row_norm(m01, m11, m21, m31, hc_eps)
    m02, m12, m22, m32 = _row_norm(m02, m12, m22, m32, hc_eps)
    m03, m13, m23, m33 = _row_norm(m03, m13, m23, m33, hc_eps)
    for _ in range(iters - 1):
        m00, m01, m02, m03 = _row_norm(m00, m01, m02, m03, hc_eps)
        m10, m11, m12, m13 = _row_norm(m10, m11, m12, m13, hc_eps)
        m20, m21, m22, m23 = _row_norm(m20, m21, m22, m23, hc_eps)
        m30, m31, m32, m33 = _row_norm(m30, m31, m32, m33, hc_eps)
        m00, m10, m20, m30 = _row_norm(m00, m10, m20, m30, hc_eps)
        m01, m11, m21, m31 = _row_norm(m01, m11, m21, m31, hc_eps)
        m02, m12, m22, m32 = _row_norm(m02, m12, m22, m32, hc_eps)
        m03, m13, m23, m33 = _row_norm(m03, m13, m23, m33, hc_eps)
    out = out_ptr + t.to(tl.int64) * 16
    tl.store(out + 0, m00, mask=ok)
    tl.store(out + 1, m01, mask=ok)
    tl.store(out + 2, m02, mask=ok)
    tl.store(out + 3, m03, mask=ok)
    tl.store(out + 4, m10, mask=ok)
    tl.store(out + 5, m11, mask=ok)
    tl.store(out + 6, m12, mask=ok)
    tl.store(out + 7, m13, mask=ok)
    tl.store(out + 8, m20, mask=ok)
    tl.store(out + 9, m21, mask=ok)
    tl.store(out + 10, m22, mask=ok)
    tl.store(out + 11, m23, mask=ok)
    tl.store(out + 12, m30, mask=ok)
    tl.store(out + 13, m31, mask=ok)
    tl.store(out + 14, m32, mask=ok)
    tl.store(out + 15, m33, mask=ok)


@triton.jit
def _sinkhorn_tile_kernel(c_ptr, out_ptr, hc_eps, iters):
    # The finalize's current structure, isolated: one token per program, reductions over a tile.
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, 4)
    ij = i[:, None] * 4 + i[None, :]
    c = tl.load(c_ptr + t * 16 + ij)
    c = tl.exp(c - tl.max(c, axis=1)[:, None])
    c = c / tl.sum(c, axis=1)[:, None] + hc_eps
    c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
        c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
    tl.store(out_ptr + t * 16 + ij, c)


def sinkhorn_scalar(c: torch.Tensor, hc_eps: float, iters: int, block_t: int = 32) -> torch.Tensor:
    """``c [T, 4, 4]`` fp32 comb logits -> the doubly-normalised ``[T, 4, 4]``."""
    t = c.shape[0]
    c = c.float().contiguous()
    out = torch.empty_like(c)
    if t:
        _sinkhorn_scalar_kernel[(triton.cdiv(t, block_t),)](
            c, out, t, float(hc_eps), int(iters), BLOCK_T=block_t, num_warps=1
        )
    return out


def sinkhorn_tile(c: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    """The same with the finalize's per-token tile reductions (the baseline)."""
    c = c.float().contiguous()
    out = torch.empty_like(c)
    if c.shape[0]:
        _sinkhorn_tile_kernel[(c.shape[0],)](c, out, float(hc_eps), int(iters), num_warps=1)
    return out
