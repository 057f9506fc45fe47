"""Asking the L2 cache for whole weight rows ahead of use, inside a Triton kernel (sm_90+)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def prefetch_rows_l2(row_ptrs, row_bytes):
    """Start an L2 fill of ``row_bytes`` bytes at each of ``row_ptrs`` (one bulk prefetch a row,
    ``cp.async.bulk.prefetch.L2``): a hint that returns at once, so a tile can put its whole
    weight slab in flight before it waits or loops. Rows must be 16-byte aligned and
    ``row_bytes`` a multiple of 16. Not available under the Triton interpreter."""
    nbytes = tl.full(row_ptrs.shape, row_bytes, tl.int32)
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [row_ptrs, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def rows_prefetchable(t: torch.Tensor) -> bool:
    """Whether every row of ``t`` (last dimension contiguous) starts 16-byte aligned and spans a
    multiple of 16 bytes, as :func:`prefetch_rows_l2` needs."""
    size = t.element_size()
    return (
        t.data_ptr() % 16 == 0
        and (t.shape[-1] * size) % 16 == 0
        and all((s * size) % 16 == 0 for s in t.stride()[:-1])
    )
