"""Activations gathered into the expert-sorted row order of ``moe_align_block_size``, optionally
quantised to FP8 in the same pass.

Row ``p`` of the result is the token of sorted slot ``sorted_ids[p]`` (``slot // top_k``), or zeros
for a padding slot (``>= num_slots``); rows past the used length (``ntpp``) are left unwritten.
With ``group`` the rows are quantised per ``group`` columns by ``quant_rows_fp8``, the rule of
``per_token_group_quant_fp8``, so a row's values and scales equal that quantiser's for its token
bit for bit. The gate-up GEMM then reads its activations as plain tiles through a tensor
descriptor instead of gathering rows by token inside its K loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.quant.fp8 import DEFAULT_EPS, FP8_DTYPE, quant_rows_fp8

_GROUPS_PER_PROGRAM = 8  # 1024 columns of 128: enough work a CTA without spilling


@triton.jit
def _sorted_rows_kernel(
    x_ptr,
    out_ptr,
    out_scale_ptr,
    sorted_ids_ptr,
    ntpp_ptr,
    num_slots,
    top_k,
    hidden,
    stride_x,
    stride_o,
    stride_os,
    eps,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
    QUANT: tl.constexpr,
):
    p = tl.program_id(0)
    used = tl.load(ntpp_ptr)
    slot = tl.load(sorted_ids_ptr + p)
    src = tl.where(slot < num_slots, slot // top_k, 0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    # Row conditions spread over the tile: the interpreter takes no scalar in a mask.
    live = (cols < hidden) & ((cols * 0 + p) < used)
    taken = live & ((cols * 0 + slot) < num_slots)
    x = tl.load(x_ptr + src * stride_x + cols, mask=taken, other=0.0)
    x = x.to(tl.float32)
    out_ptrs = out_ptr + p.to(tl.int64) * stride_o + cols
    if QUANT:
        q, s = quant_rows_fp8(x, eps)
        tl.store(out_ptrs, q.to(out_ptr.dtype.element_ty), mask=live)
        s_ptrs = out_scale_ptr + p.to(tl.int64) * stride_os + groups
        tl.store(s_ptrs, s, mask=(groups * GROUP < hidden) & ((groups * 0 + p) < used))
    else:
        tl.store(out_ptrs, x.to(out_ptr.dtype.element_ty), mask=live)


def gather_sorted_rows(
    x: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    top_k: int,
    num_slots: int,
    group: int | None = None,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` [T, H] -> (rows [P, H] in sorted order, scales [P, H/group] fp32 or None).

    ``align`` is ``moe_align_block_size``'s (sorted_ids [P], expert_ids, ntpp [1]). Without
    ``group`` the rows keep ``x``'s dtype; with it they are e4m3 (``group`` a power of two that
    divides H)."""
    sorted_ids, _, ntpp = align
    rows, hidden = sorted_ids.shape[0], x.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    block = group or 128
    if group is not None and (hidden % group or group & (group - 1)):
        raise ValueError(f"group {group} must be a power of two dividing H={hidden}")
    out = torch.empty((rows, hidden), dtype=FP8_DTYPE if group else x.dtype, device=x.device)
    scale = None
    if group is not None:
        scale = torch.empty((rows, hidden // group), dtype=torch.float32, device=x.device)
    groups = min(_GROUPS_PER_PROGRAM, triton.next_power_of_2(triton.cdiv(hidden, block)))
    if rows:
        grid = (rows, triton.cdiv(triton.cdiv(hidden, block), groups))
        _sorted_rows_kernel[grid](
            x,
            out,
            scale if scale is not None else out,
            sorted_ids,
            ntpp,
            num_slots,
            top_k,
            hidden,
            x.stride(0),
            out.stride(0),
            scale.stride(0) if scale is not None else 0,
            eps,
            GROUP=block,
            GROUPS=groups,
            QUANT=group is not None,
            num_warps=4,
        )
    return out, scale
