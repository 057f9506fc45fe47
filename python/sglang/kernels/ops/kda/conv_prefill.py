"""KDA's short causal depthwise conv + SiLU over the ``T`` rows of one prefill segment, in one
launch, continued from the segment's conv state.

Per row ``t`` and channel ``c`` (width ``W``; the ``W - 1`` rows before the first come from the
state ``S [W - 1, C]``):
  y[t, c] = silu(sum_{j < W} w[c, j] * x_{t - W + 1 + j}[c])     fp32, then x.dtype, row-major
The torch form is ``causal_conv_prefill`` in ``srt/layers/attention/kda_conv.py`` (a grouped
``conv1d`` over the state and the rows); the sums run in another order, so an output may differ
from it by one rounding step of x's dtype. The new state (the last ``W - 1`` pre-conv rows) is
a copy and stays with the caller.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32
BLOCK_C = 256


@triton.jit
def _conv_prefill_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    T,
    channels,
    x_stride,
    out_stride,
    W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < channels
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W):
        src = t - (W - 1) + j  # the input row this tap reads; < 0: a state row
        in_x = (src >= 0) & (src < T)
        in_s = (src < 0) & (t < T)
        xs = tl.load(
            x_ptr + src.to(tl.int64)[:, None] * x_stride + c[None, :],
            mask=in_x[:, None] & cmask[None, :],
            other=0.0,
        )
        ss = tl.load(
            state_ptr + (src + (W - 1))[:, None] * channels + c[None, :],
            mask=in_s[:, None] & cmask[None, :],
            other=0.0,
        )
        tap = tl.load(w_ptr + c * W + j, mask=cmask, other=0.0).to(tl.float32)
        acc += (xs.to(tl.float32) + ss.to(tl.float32)) * tap[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    offs = t.to(tl.int64)[:, None] * out_stride + c[None, :]
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=(t < T)[:, None] & cmask[None, :])


def kda_conv_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``x [T, C]`` (unit channel stride), ``weight [C, W]``, ``state [W - 1, C]`` (contiguous)
    -> ``silu(conv) [T, C]`` in x's dtype, row-major."""
    t, c = x.shape
    width = weight.shape[1]
    if weight.shape[0] != c or state.shape != (width - 1, c) or x.stride(1) != 1:
        raise ValueError(
            f"KDA conv prefill: x {tuple(x.shape)} (strides {x.stride()}), weight "
            f"{tuple(weight.shape)} and state {tuple(state.shape)} do not fit"
        )
    out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    grid = (triton.cdiv(t, BLOCK_T), triton.cdiv(c, BLOCK_C))
    _conv_prefill_kernel[grid](
        x, weight.contiguous(), state.contiguous(), out, t, c, x.stride(0), out.stride(0),
        W=width, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
    )  # fmt: skip
    return out
