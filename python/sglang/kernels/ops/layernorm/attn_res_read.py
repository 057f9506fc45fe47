"""Kimi K3's AttnRes read in one Triton launch: softmax-mix the rows ``[bank..., P]`` of each token
by how they score against a learned vector, round the mix, then RMSNorm it.

Per token (one program), over ``rows [T, R, H]`` (any token/row strides, contiguous H):
  score_r = rsqrt(mean(rows_r^2) + eps) * <rows_r, score_vector>     (fp32)
  mix     = sum_r softmax(score)_r * rows_r                          (fp32, cast to out's dtype)
  out     = rms_norm(mix, out_weight, out_eps)
The torch reference (``srt/layers/attn_res.py``) normalises the rows before the dot; scaling after
it is the same product up to rounding. Two passes over the rows (scores, then the mix) and one over
the token's own output (the norm of the rounded mix, as a separate RMSNorm would see it), so a
decode read is one launch instead of ~15 small ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import limits_for, unfit_reason
from sglang.kernels.fit.footprint import tile_footprint


@triton.jit
def _attn_res_read_kernel(
    rows_ptr,
    score_ptr,
    weight_ptr,
    out_ptr,
    stride_t,
    stride_r,
    H,
    R,
    eps,
    out_eps,
    R_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, R_PAD)
    r_ok = r < R
    base = rows_ptr + t * stride_t + r.to(tl.int64)[:, None] * stride_r
    sq = tl.zeros([R_PAD], dtype=tl.float32)
    dot = tl.zeros([R_PAD], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs < H
        x = tl.load(base + offs[None, :], mask=r_ok[:, None] & h_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        sv = tl.load(score_ptr + offs, mask=h_ok, other=0.0)
        sq += tl.sum(x * x, axis=1)
        dot += tl.sum(x * sv[None, :], axis=1)
    score = tl.where(r_ok, dot / tl.sqrt(sq / H + eps), float("-inf"))
    e = tl.exp(score - tl.max(score, axis=0))
    alpha = e / tl.sum(e, axis=0)

    out_ty = out_ptr.dtype.element_ty
    out_row = out_ptr + t * H
    ysq = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs < H
        x = tl.load(base + offs[None, :], mask=r_ok[:, None] & h_ok[None, :], other=0.0)
        mix = tl.sum(alpha[:, None] * x.to(tl.float32), axis=0).to(out_ty)
        tl.store(out_row + offs, mix, mask=h_ok)
        mf = mix.to(tl.float32)
        ysq += mf * mf
    rn = 1.0 / tl.sqrt(tl.sum(ysq, axis=0) / H + out_eps)
    tl.debug_barrier()  # the norm pass re-reads this program's own stores
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs < H
        y = tl.load(out_row + offs, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + offs, mask=h_ok, other=0.0).to(tl.float32)
        tl.store(out_row + offs, (y * rn * w).to(out_ty), mask=h_ok)


def _block_h(r_pad: int) -> int:
    return max(128, min(1024, 8192 // r_pad))  # ~64 fp32 row values a thread


def attn_res_read_unfit_reason(rows: torch.Tensor) -> str | None:
    """None when the kernel reads ``rows [T, R, H]`` here (a float dtype, the family on, its
    ``[R, BLOCK_H]`` tile within the device's limits), else why the torch read runs."""
    if rows.dim() != 3 or rows.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"rows {tuple(rows.shape)} {rows.dtype}: the kernel reads [T, R, H] float rows"
    r_pad = max(2, triton.next_power_of_2(rows.shape[1]))
    return unfit_reason(
        "attn_res_read", tile_footprint(r_pad * _block_h(r_pad), 4), limits_for(rows)
    )


def attn_res_read(
    rows: torch.Tensor,
    score_vector: torch.Tensor,
    out_weight: torch.Tensor,
    eps: float,
    out_eps: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """``rows [T, R, H]`` (the bank rows then the partial sum, activation dtype), fp32
    ``score_vector [H]``, the out norm's ``out_weight [H]`` -> ``out [T, H]`` (written and
    returned)."""
    t, n_rows, h = rows.shape
    if rows.stride(2) != 1:
        raise ValueError("AttnRes rows must be contiguous along the hidden dim")
    if out.shape != (t, h) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{t}, {h}] tensor, got {tuple(out.shape)}")
    if n_rows == 0:
        raise ValueError("an AttnRes read needs at least one row (the partial sum)")
    if t == 0:
        return out
    r_pad = max(2, triton.next_power_of_2(n_rows))
    _attn_res_read_kernel[(t,)](
        rows,
        score_vector.float().contiguous(),
        out_weight.contiguous(),
        out,
        rows.stride(0),
        rows.stride(1),
        h,
        n_rows,
        float(eps),
        float(out_eps),
        R_PAD=r_pad,
        BLOCK_H=_block_h(r_pad),
        num_warps=4,
    )
    return out
