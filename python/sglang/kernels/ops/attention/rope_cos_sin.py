"""RoPE ``cos``/``sin`` of a batch of positions in one launch (the torch maths,
:func:`~sglang.kernels.ops.attention.rope.rope_cos_sin_torch`, is six elementwise launches).

The same fp32 maths: ``angle = float(pos) * inv_freq`` (one fp32 product), then ``cos``/``sin``
times ``attention_factor``. On the GPU the trig is libdevice's ``__nv_cosf``/``__nv_sinf`` (full
range reduction, the functions torch's CUDA ``cos``/``sin`` compile to); Triton's own ``tl.cos``
may lower to the ``approx`` instructions, whose error grows with the angle (V4's positions reach
1M radians), so without libdevice the caller takes the torch path. The interpreter uses numpy's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.ops.triton_dispatch import interpreter_enabled

try:  # the path moved between Triton versions; it is absent in some builds
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the Triton build
    libdevice = None

_BLOCK_N = 16  # positions a program (the interpreter, whose cost is per program, takes 256)


@triton.jit
def _cos_sin_kernel(
    pos_ptr,
    inv_ptr,
    cos_ptr,
    sin_ptr,
    n,
    factor,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < n
    col_ok = cols < HALF
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    inv = tl.load(inv_ptr + cols, mask=col_ok, other=0.0)
    angle = pos[:, None] * inv[None, :]
    if LIBDEVICE:
        c = libdevice.cos(angle)
        s = libdevice.sin(angle)
    else:
        c = tl.cos(angle)
        s = tl.sin(angle)
    off = rows.to(tl.int64)[:, None] * HALF + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(cos_ptr + off, c * factor, mask=mask)
    tl.store(sin_ptr + off, s * factor, mask=mask)


def rope_cos_sin_unfit_reason(positions: torch.Tensor, inv_freq: torch.Tensor) -> str | None:
    """Why :func:`rope_cos_sin` cannot take these tensors (None: it can)."""
    if positions.dtype not in (torch.int32, torch.int64):
        return f"positions are {positions.dtype}, the kernel takes int32 / int64"
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1:
        return f"inv_freq must be a 1-D fp32 tensor, got {inv_freq.dtype} {tuple(inv_freq.shape)}"
    if inv_freq.device != positions.device:
        return f"inv_freq is on {inv_freq.device}, positions on {positions.device}"
    if libdevice is None and not interpreter_enabled():
        return "this Triton build has no triton.language.extra.libdevice (accurate cos/sin)"
    return unfit_reason("rope_cos_sin")  # one warp, no shared memory to speak of (1 KiB)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [...]`` -> fp32 ``(cos, sin)`` ``[..., len(inv_freq)]``, as
    :func:`~sglang.kernels.ops.attention.rope.rope_cos_sin_torch` (one launch)."""
    reason = rope_cos_sin_unfit_reason(positions, inv_freq)
    if reason is not None:
        raise ValueError(f"rope_cos_sin: {reason}")
    half = inv_freq.shape[0]
    flat = positions.reshape(-1)
    n = flat.shape[0]
    cos = torch.empty(n, half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if n:
        block_n = 256 if interpreter_enabled() else _BLOCK_N
        _cos_sin_kernel[(triton.cdiv(n, block_n),)](
            flat,
            inv_freq.contiguous(),
            cos,
            sin,
            n,
            float(attention_factor),
            HALF=half,
            BLOCK_N=block_n,
            BLOCK_H=triton.next_power_of_2(half),
            LIBDEVICE=not interpreter_enabled(),
            num_warps=1 if half <= 32 else 2,
        )
    shape = (*positions.shape, half)
    return cos.view(shape), sin.view(shape)
