"""Per-row RMSNorm (weighted, unweighted or none), then interleaved RoPE on the last rope dims
(forward or inverse), then a cast: one launch for what DeepSeek V4's attention runs as a dozen or
more torch elementwise ops per tensor (q, kv, the indexer q, the output's inverse rope, q_norm).

Rows are ``x [T, heads, D]`` (any strides on T and heads, the last dim contiguous); ``cos``/``sin``
are fp32 ``[T, rope / 2]``, shared by a token's heads. The maths is the torch reference's,
:func:`norm_rope_torch` (fp32 statistics and rotation), rounded where the torch ops round: every
one of them returns x's dtype, so the normed row is rounded to it before the rope reads it, the
rotated row again, and only then cast to ``out``'s dtype. Only the sum of squares (its order) and
the rsqrt / fused multiply-adds (the last fp32 ulp) differ.

A program reads every channel of its rows before it writes that channel (the rope pairs are
read apart from the pass-through channels, which are written first), so ``out`` may be ``x``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import limits_for, unfit_reason
from sglang.kernels.fit.footprint import tile_footprint
from sglang.kernels.ops.attention.rope import apply_interleaved_rope
from sglang.kernels.ops.layernorm.rms_norm import rms_norm, unweighted_rms_norm
from sglang.kernels.ops.triton_dispatch import interpreter_enabled

Norm = Literal["none", "unweighted", "weighted"]
_NORM_CODE = {"none": 0, "unweighted": 1, "weighted": 2}


@dataclass(frozen=True)
class RowNorm:
    """The RMSNorm each row gets before its rope: ``kind`` none, unweighted or weighted (by
    ``weight``, over the row's last dim), with ``eps``."""

    kind: Norm = "none"
    weight: torch.Tensor | None = None
    eps: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in _NORM_CODE:
            raise ValueError(f"unknown norm {self.kind!r}; expected one of {tuple(_NORM_CODE)}")

    @classmethod
    def weighted(cls, weight: torch.Tensor, eps: float) -> RowNorm:
        return cls("weighted", weight, eps)

    @classmethod
    def unweighted(cls, eps: float) -> RowNorm:
        return cls("unweighted", None, eps)


NO_NORM = RowNorm()
_MAX_D = 16384  # one row per program in registers
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    out_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    n_rows,
    heads,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_c,
    eps,
    D: tl.constexpr,
    ROPE: tl.constexpr,
    NORM: tl.constexpr,
    INVERSE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    in_ty = x_ptr.dtype.element_ty
    out_ty = out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    t = (rows // heads).to(tl.int64)
    h = (rows % heads).to(tl.int64)
    x_row = x_ptr + (t * stride_xt + h * stride_xh)[:, None]
    out_row = out_ptr + (t * stride_ot + h * stride_oh)[:, None]
    cols = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (cols < D)[None, :]
    x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # The norm as torch computes it, rounded to x's dtype: weighted ``(x * r) * w`` in fp32
    # (rms_norm); unweighted ``x * r`` with r rounded to x's dtype first (unweighted_rms_norm).
    r = tl.zeros([BLOCK_R], tl.float32)
    if NORM != 0:
        r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        if NORM == 1:
            r = r.to(in_ty).to(tl.float32)
        x = x * r[:, None]
        if NORM == 2:
            x = x * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        x = x.to(in_ty).to(tl.float32)
    # The pass-through channels; the rope part is written below, from its own (L1) loads.
    keep = row_ok[:, None] & (cols < D - ROPE)[None, :]
    tl.store(out_row + cols[None, :], x.to(out_ty), mask=keep)
    if ROPE > 0:
        i = tl.arange(0, BLOCK_H)
        i_ok = i < ROPE // 2
        pair = row_ok[:, None] & i_ok[None, :]
        ev = (D - ROPE) + 2 * i  # pair i: channels (ev, ev + 1), as a complex number
        e = tl.load(x_row + ev[None, :], mask=pair, other=0.0).to(tl.float32)
        o = tl.load(x_row + ev[None, :] + 1, mask=pair, other=0.0).to(tl.float32)
        if NORM != 0:  # the same norm on the pair (the row's r, the pair's weights)
            e = e * r[:, None]
            o = o * r[:, None]
            if NORM == 2:
                e = e * tl.load(w_ptr + ev, mask=i_ok, other=0.0).to(tl.float32)[None, :]
                o = o * tl.load(w_ptr + ev + 1, mask=i_ok, other=0.0).to(tl.float32)[None, :]
            e = e.to(in_ty).to(tl.float32)
            o = o.to(in_ty).to(tl.float32)
        cs = (t * stride_c)[:, None] + i[None, :]
        c = tl.load(cos_ptr + cs, mask=pair, other=0.0)
        s = tl.load(sin_ptr + cs, mask=pair, other=0.0)
        if INVERSE:
            s = -s
        # torch returns the rotation in x's dtype; the caller's cast comes after
        tl.store(out_row + ev[None, :], (e * c - o * s).to(in_ty).to(out_ty), mask=pair)
        tl.store(out_row + ev[None, :] + 1, (o * c + e * s).to(in_ty).to(out_ty), mask=pair)


def gpu_rows_per_program(n_rows: int, block_d: int) -> int:
    """Decode (few rows): a row a program, for the most programs; prefill: ~2K elements each."""
    return 1 if n_rows <= 1024 else max(1, min(16, 2048 // block_d))


def _rows_per_program(n_rows: int, block_d: int) -> int:
    if interpreter_enabled():  # its cost is per program: few large ones (same code, other tiles)
        return max(1, min(64, 16384 // block_d))
    return gpu_rows_per_program(n_rows, block_d)


def norm_rope_torch(
    x: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    *,
    norm: RowNorm = NO_NORM,
    inverse: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The reference: the torch ops the kernel fuses, in order (``x [T, ..., D]``)."""
    y = x
    if norm.kind == "unweighted":
        y = unweighted_rms_norm(y, norm.eps)
    elif norm.kind == "weighted":
        y = rms_norm(y, norm.weight, norm.eps)
    if cos is not None:
        assert sin is not None
        y = apply_interleaved_rope(y, cos, sin, inverse=inverse)
    return y.to(dtype or x.dtype)


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1) if t.dim() == 2 else t


def norm_rope_unfit_reason(
    x: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    norm: RowNorm,
) -> str | None:
    """Why :func:`norm_rope` cannot take these tensors (None: it can)."""
    if x.dim() not in (2, 3):
        return f"x must be [T, D] or [T, heads, D], got {tuple(x.shape)}"
    if out.shape != x.shape:
        return f"out has shape {tuple(out.shape)}, x {tuple(x.shape)}"
    if x.dtype not in _FLOATS or out.dtype not in _FLOATS:
        return f"x / out are {x.dtype} / {out.dtype}; the kernel takes fp32, bf16, fp16"
    if out.device != x.device:
        return f"out is on {out.device}, x on {x.device}"
    if x.shape[-1] > _MAX_D:
        return f"rows of {x.shape[-1]} exceed the kernel's {_MAX_D}"
    # A program holds at most max(2048, D) values (gpu_rows_per_program) in registers.
    block_d = triton.next_power_of_2(x.shape[-1])
    why = unfit_reason("norm_rope", tile_footprint(max(2048, block_d), 8), limits_for(x))
    if why is not None:
        return why
    if x.numel() and (x.stride(-1) != 1 or out.stride(-1) != 1):
        return "the last dim of x and out must be contiguous"
    if out.data_ptr() == x.data_ptr() and out.stride() != x.stride():
        return "out aliases x with other strides"
    weight = norm.weight
    if norm.kind == "weighted":
        if weight is None or weight.shape != (x.shape[-1],):
            got = None if weight is None else tuple(weight.shape)
            return f"the weighted norm needs a weight of shape ({x.shape[-1]},), got {got}"
        if weight.device != x.device or not weight.is_contiguous():
            return "the norm weight must be contiguous, on x's device"
    if (cos is None) != (sin is None):
        return "cos and sin come together"
    if cos is not None and sin is not None:
        want = (x.shape[0], cos.shape[-1])
        if 2 * cos.shape[-1] > x.shape[-1]:
            return f"rope_dim {2 * cos.shape[-1]} exceeds the head dim {x.shape[-1]}"
        for name, c in (("cos", cos), ("sin", sin)):
            if c.dim() != 2 or tuple(c.shape) != want or c.dtype != torch.float32:
                return f"{name} must be fp32 {want}, got {c.dtype} {tuple(c.shape)}"
            if c.device != x.device or c.stride(-1) != 1:
                return f"{name} must have a contiguous last dim, on x's device"
        if cos.stride() != sin.stride():
            return "cos and sin must have the same strides"
    return None


def norm_rope(
    x: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    *,
    out: torch.Tensor,
    norm: RowNorm = NO_NORM,
    inverse: bool = False,
) -> torch.Tensor:
    """``x [T, D]`` or ``[T, heads, D]`` -> ``out`` (same shape, any float dtype; may be ``x``):
    :func:`norm_rope_torch` of the same arguments, ``dtype=out.dtype``, in one launch."""
    reason = norm_rope_unfit_reason(x, out, cos, sin, norm)
    if reason is not None:
        raise ValueError(f"norm_rope: {reason}")
    xr, outr = _rows_view(x), _rows_view(out)
    tokens, heads, d = xr.shape
    n_rows = tokens * heads
    if n_rows == 0:
        return out
    block_d = triton.next_power_of_2(d)
    block_r = _rows_per_program(n_rows, block_d)
    rope = 0 if cos is None else 2 * cos.shape[-1]
    dummy = xr  # never read: the flags below turn the loads off
    _norm_rope_kernel[(triton.cdiv(n_rows, block_r),)](
        xr,
        outr,
        norm.weight if norm.weight is not None else dummy,
        cos if cos is not None else dummy,
        sin if sin is not None else dummy,
        n_rows,
        heads,
        xr.stride(0),
        xr.stride(1),
        outr.stride(0),
        outr.stride(1),
        cos.stride(0) if cos is not None else 0,
        float(norm.eps),
        D=d,
        ROPE=rope,
        NORM=_NORM_CODE[norm.kind],
        INVERSE=inverse,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        BLOCK_H=triton.next_power_of_2(max(rope // 2, 1)),
        num_warps=min(8, max(1, block_r * block_d // 256)),
    )
    return out
