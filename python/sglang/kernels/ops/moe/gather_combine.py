"""Gather-and-combine: ``out[t] = sum_k w[t, k] * src[row_of[t, k]]`` (rows with ``row_of < 0``
skipped), accumulated in fp32 and stored in ``out``'s dtype.

The last step of a grouped-GEMM MoE whose expert rows live in a permuted layout (DeepGEMM's
contiguous or masked one): one pass over the routed rows, with no ``[T, k, H]`` temporary.
Triton on CUDA (and under the interpreter), torch elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.ops.triton_dispatch import triton_can_run


@triton.jit
def _gather_combine_kernel(
    src_ptr,
    row_of_ptr,
    w_ptr,
    out_ptr,
    hidden,
    stride_src,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        row = tl.load(row_of_ptr + token * TOP_K + s).to(tl.int64)
        w = tl.load(w_ptr + token * TOP_K + s).to(tl.float32)
        ok = mask & (row >= 0)
        v = tl.load(src_ptr + row * stride_src + offs, mask=ok, other=0.0)
        acc += tl.where(ok, v.to(tl.float32) * w, 0.0)
    tl.store(out_ptr + token * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gather_combine_torch(
    src: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    valid = row_of >= 0
    rows = src[row_of.clamp_min(0).long()].float()  # [T, k, H]
    w = torch.where(valid, weights.float(), 0.0).unsqueeze(-1)
    out.copy_(torch.where(valid.unsqueeze(-1), rows * w, 0.0).sum(dim=1))
    return out


def gather_combine_unfit_reason(src: torch.Tensor) -> str | None:
    """None when the kernel sums rows of ``src`` (a float dtype; the family on; 1024 columns a
    program in registers), else why the torch gather and sum run."""
    if src.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"rows of {src.dtype}: the kernel sums fp32, bf16 or fp16 rows"
    return unfit_reason("moe_gather_combine")


def gather_combine(
    src: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``src [R, H]``, ``row_of [T, k]`` (int, -1 = skip), ``weights [T, k]`` -> ``out [T, H]``."""
    t, k = row_of.shape
    if src.dim() != 2 or out.shape != (t, src.shape[1]) or weights.shape != (t, k):
        raise ValueError(
            f"gather_combine: src {tuple(src.shape)}, row_of {tuple(row_of.shape)}, weights "
            f"{tuple(weights.shape)}, out {tuple(out.shape)} do not fit"
        )
    if not triton_can_run(src) or gather_combine_unfit_reason(src) is not None:
        return gather_combine_torch(src, row_of, weights, out)
    if t == 0:
        return out
    hidden = src.shape[1]
    src = src if src.stride(1) == 1 else src.contiguous()
    block = min(1024, triton.next_power_of_2(hidden))
    grid = (t, triton.cdiv(hidden, block))
    _gather_combine_kernel[grid](
        src,
        row_of.contiguous(),
        weights.contiguous(),
        out,
        hidden,
        src.stride(0),
        out.stride(0),
        TOP_K=k,
        BLOCK=block,
        num_warps=4,
    )
    return out
