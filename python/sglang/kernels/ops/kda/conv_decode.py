"""KDA's short causal depthwise conv + SiLU for one new token of each of ``B`` requests, reading
and shifting every request's conv state in place (one launch, no stack, no copy back).

Per decode row ``i`` (batch row ``rows[i]`` of ``x``, state ``S_i [W - 1, C]`` at
``state_ptrs[i]``, in ``x``'s dtype) and channel ``c``:
  y[i, c] = silu(sum_{j < W-1} w[c, j] * S_i[j, c] + w[c, W-1] * x[rows[i], c])   fp32, then x.dtype
  S_i <- [S_i[1:], x[rows[i]]]
The torch form is ``causal_conv_decode`` in ``srt/layers/attention/kda_conv.py``; the sums run in
another order, so an output may differ from it by one bf16 rounding step. The state shift is
exact (the values are moved, not recomputed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_C = 1024
# Programs over (channel block, group of rows), enough groups to fill the GPU. The conv reaches
# only ~0.7 TB/s on the H200 (docs/performance.md); one row a program measured the same. Its
# weight reads (one tap a load, W floats apart) are the suspect: a [BLOCK_C, W] vector tile
# loaded once a program is the next thing to try.
_TARGET_PROGRAMS = 264  # two waves of the H200's 132 SMs


@triton.jit
def _conv_decode_kernel(
    x_ptr,
    w_ptr,
    rows_ptr,
    state_ptrs,
    out_ptr,
    x_stride,
    channels,
    n_rows,
    rows_per_program,
    W: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = c < channels
    first = tl.program_id(1) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for i in range(first, last):
        row = tl.load(rows_ptr + i)
        addr = tl.load(state_ptrs + i).to(tl.pointer_type(x_ptr.dtype.element_ty))
        state = tl.multiple_of(addr, 16)
        x = tl.load(x_ptr + row * x_stride + c, mask=mask, other=0.0)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        # Row j moves to j - 1 right after it is read; each element is read and written by the
        # same thread, and row j - 1 was read one iteration earlier.
        for j in tl.static_range(W - 1):
            s_j = tl.load(state + j * channels + c, mask=mask, other=0.0)
            acc += s_j.to(tl.float32) * tl.load(w_ptr + c * W + j, mask=mask, other=0.0)
            if j > 0:
                tl.store(state + (j - 1) * channels + c, s_j, mask=mask)
        tl.store(state + (W - 2) * channels + c, x, mask=mask)
        acc += x.to(tl.float32) * tl.load(w_ptr + c * W + (W - 1), mask=mask, other=0.0)
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + i * channels + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def kda_conv_decode_(
    x: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    state_ptrs: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``x [T, C]`` (batch rows), fp32 ``weight [C, W]``, int64 ``rows [B]`` (which batch row
    each decode row reads) and ``state_ptrs [B]`` (each a contiguous ``[W - 1, C]`` state in
    ``x.dtype``, 16-byte aligned): writes ``out [B, C]`` (``x.dtype``) and shifts every state in
    place."""
    c, width = weight.shape
    b = rows.shape[0]
    if x.dim() != 2 or x.shape[1] != c or x.stride(1) != 1:
        raise ValueError(f"conv input {tuple(x.shape)} must be [T, {c}] with unit channel stride")
    if weight.dtype != torch.float32 or not weight.is_contiguous() or width < 2:
        raise ValueError(f"conv weight must be contiguous fp32 [C, W >= 2], got {weight.dtype}")
    if rows.dtype != torch.int64 or state_ptrs.shape != (b,) or state_ptrs.dtype != torch.int64:
        raise ValueError("rows and state_ptrs must be int64 [B]")
    if out.shape != (b, c) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {x.dtype} [{b}, {c}], got {tuple(out.shape)}")
    if b == 0:
        return
    blocks = triton.cdiv(c, _BLOCK_C)
    groups = min(b, triton.cdiv(_TARGET_PROGRAMS, blocks))
    per_program = triton.cdiv(b, groups)
    grid = (blocks, triton.cdiv(b, per_program))
    _conv_decode_kernel[grid](
        x, weight, rows, state_ptrs, out, x.stride(0), c, b, per_program, W=width, BLOCK_C=_BLOCK_C
    )
