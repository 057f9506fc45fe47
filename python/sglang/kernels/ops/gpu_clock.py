"""Reading the GPU's global nanosecond timer inside a Triton kernel (for bounded waits)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def globaltimer_ns():
    """``%globaltimer`` in nanoseconds. Coarse (about a microsecond a tick), but shared by every
    SM, so a wait measured with it means wall time, not one SM's cycles. Not available under the
    Triton interpreter: callers bound their waits by iterations there."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
