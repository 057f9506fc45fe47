"""Rounding an fp32 value to the dtype an unfused path stores, inside a kernel: the fused
epilogues (the FP8 GEMM's, the fused quantisers') round where the unfused ops would have written
a bf16 / fp16 tensor, so their FP8 output equals quantising that tensor."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The ``ROUND`` constexpr of :func:`round_to` for each stored dtype (0: fp32, no rounding).
ROUND_CODES: dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}


@triton.jit
def round_to(x, ROUND: tl.constexpr):
    """``x`` (fp32) rounded to the dtype of code ``ROUND`` (:data:`ROUND_CODES`), back in fp32."""
    if ROUND == 1:
        x = x.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x
