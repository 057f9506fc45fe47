"""``tl.dot`` with fp32 accumulation that also runs under the Triton interpreter."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, DOT_F32: tl.constexpr):
    """``a @ b (+ acc)``, fp32 accumulation. ``DOT_F32`` (pass ``interpreter_enabled()``): the
    interpreter's bf16 dot is wrong (measured on Triton 3.9), so it gets the same bf16 values as
    fp32 operands, which hold them exactly."""
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)
