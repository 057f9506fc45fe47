"""One KDA delta-rule step for every single-token decode row, in one launch, each request's fp32
recurrent state read once and written back in place.

Per decode row ``i`` (batch row ``r = rows[i]``, state ``S [H, V, K]`` at ``state_ptrs[i]``,
V-major as SGLang stores it) and head ``h``, optionally after ``q = l2norm(q) * q_scale`` and
``k = l2norm(k)`` (``l2norm(x) = x / sqrt(sum(x^2) + eps)``):
  S <- S * exp(g[r, h])[None, :]
  u  = beta[r, h] * (v - S k)
  S <- S + u k^T
  o[r, h] = S q
Programs run over (row, head, block of V rows of S): each reads its ``[BLOCK_V, K]`` tile once.
Everything is fp32 (q/k/v/beta may come in bf16 and are upcast). The torch form is
``kda_recurrent`` in ``srt/layers/attention/kda_recurrent.py``; only summation orders and the
exp differ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest key width: a [BLOCK_V, K] fp32 tile stays in registers.
MAX_KEY_DIM = 256
_MIN_BLOCK_V = 8
DEFAULT_WARPS = 2


@triton.jit
def _recurrent_step_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    rows_ptr,
    state_ptrs,
    o_ptr,
    q_stride,
    k_stride,
    v_stride,
    g_stride,
    beta_stride,
    o_stride,
    q_scale,
    eps,
    K: tl.constexpr,
    V: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, K)
    row = tl.load(rows_ptr + i)
    state = tl.multiple_of(tl.load(state_ptrs + i).to(tl.pointer_type(tl.float32)), 16)
    s_ptrs = state + h * (V * K) + vs[:, None] * K + ks[None, :]
    s = tl.load(s_ptrs)
    q = tl.load(q_ptr + i * q_stride + h * K + ks).to(tl.float32)
    k = tl.load(k_ptr + i * k_stride + h * K + ks).to(tl.float32)
    if L2NORM:
        q = tl.div_rn(q, tl.sqrt_rn(tl.sum(q * q, axis=0) + eps)) * q_scale
        k = tl.div_rn(k, tl.sqrt_rn(tl.sum(k * k, axis=0) + eps))
    v = tl.load(v_ptr + i * v_stride + h * V + vs).to(tl.float32)
    g = tl.load(g_ptr + row * g_stride + h * K + ks).to(tl.float32)
    beta = tl.load(beta_ptr + row * beta_stride + h).to(tl.float32)
    s = s * tl.exp(g)[None, :]
    u = beta * (v - tl.sum(s * k[None, :], axis=1))
    s = s + u[:, None] * k[None, :]
    tl.store(s_ptrs, s)
    tl.store(o_ptr + row * o_stride + h * V + vs, tl.sum(s * q[None, :], axis=1))


def recurrent_step_reason(key_dim: int, value_dim: int) -> str | None:
    """Why the kernel cannot take heads of these widths; None when it can."""
    for name, n in (("key", key_dim), ("value", value_dim)):
        if n < _MIN_BLOCK_V or n & (n - 1):
            return f"KDA {name} head dim {n} is not a power of two >= {_MIN_BLOCK_V}"
    if key_dim > MAX_KEY_DIM:
        return f"KDA key head dim {key_dim} is over the kernel's {MAX_KEY_DIM}"
    return None


def default_block_v(value_dim: int) -> int:
    """16 V rows a program (with ``DEFAULT_WARPS``): the fastest of 8-64 rows x 2-8 warps at
    K3's shape for batch 1, 16 and 64 on the H200 (``scripts/bench_kda_decode.py``)."""
    return min(16, value_dim)


def _check_row_major(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    """``t`` has ``shape`` with its last two dims packed (any stride on dim 0)."""
    if tuple(t.shape) != shape:
        raise ValueError(f"KDA {name} {tuple(t.shape)} does not match {shape}")
    if t.stride(-1) != 1 or (t.dim() == 3 and t.stride(1) != t.shape[2]):
        raise ValueError(f"KDA {name} must have packed heads, got strides {t.stride()}")


def kda_recurrent_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    rows: torch.Tensor,
    state_ptrs: torch.Tensor,
    out: torch.Tensor,
    *,
    l2norm_eps: float | None = None,
    q_scale: float = 1.0,
    block_v: int | None = None,
    num_warps: int = DEFAULT_WARPS,
) -> None:
    """``q, k [B, H, K]``, ``v [B, H, V]`` (decode row order), ``g [T, H, K]``, ``beta [T, H]``
    and ``out [T, H, V]`` (fp32, batch row order: decode row ``i`` is batch row ``rows[i]``),
    int64 ``rows [B]`` and ``state_ptrs [B]`` (each a contiguous fp32 ``[H, V, K]``, 16-byte
    aligned). Writes ``out[rows]`` and steps every state in place. With ``l2norm_eps`` the
    kernel L2-normalises q and k first and scales q by ``q_scale``."""
    b, h, dk = k.shape
    dv = v.shape[-1]
    t = g.shape[0]
    why = recurrent_step_reason(dk, dv)
    if why is not None:
        raise ValueError(why)
    _check_row_major(q, "q", (b, h, dk))
    _check_row_major(k, "k", (b, h, dk))
    _check_row_major(v, "v", (b, h, dv))
    _check_row_major(g, "g", (t, h, dk))
    _check_row_major(beta, "beta", (t, h))
    _check_row_major(out, "out", (t, h, dv))
    if out.dtype != torch.float32:
        raise ValueError(f"KDA out must be fp32, got {out.dtype}")
    if rows.shape != (b,) or state_ptrs.shape != (b,):
        raise ValueError(f"rows {tuple(rows.shape)} / state_ptrs must be [{b}]")
    if rows.dtype != torch.int64 or state_ptrs.dtype != torch.int64:
        raise ValueError("rows and state_ptrs must be int64")
    if b == 0:
        return
    bv = block_v or default_block_v(dv)
    if bv & (bv - 1) or dv % bv:
        raise ValueError(f"block_v {bv} must be a power of two dividing {dv}")
    _recurrent_step_kernel[(b, h, dv // bv)](
        q,
        k,
        v,
        g,
        beta,
        rows,
        state_ptrs,
        out,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        g.stride(0),
        beta.stride(0),
        out.stride(0),
        q_scale,
        1.0 if l2norm_eps is None else l2norm_eps,
        K=dk,
        V=dv,
        BLOCK_V=bv,
        L2NORM=l2norm_eps is not None,
        num_warps=num_warps,
    )
