"""Device tables of per-row base addresses, so one batched kernel reads and updates tensors that
live apart (one request's state each) in place, with no stack before and no copy back after.

A kernel reads row ``i``'s tensor as ``tl.load(table + i).to(tl.pointer_type(dtype))``. The
tensors must stay alive while the kernel runs: the caller keeps them (the request caches do).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Every address in a table is a multiple of this, so a kernel may assume vector-aligned rows.
POINTER_ALIGN_BYTES = 16


def pointer_table_reason(
    tensors: Sequence[torch.Tensor],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    what: str,
) -> str | None:
    """Why ``tensors`` cannot be addressed through a pointer table as contiguous ``shape`` of
    ``dtype`` on ``device``; None when they can. Two rows sharing one tensor would race, so they
    are refused."""
    for t in tensors:
        if t.device != device:
            return f"{what} is on {t.device}, the kernel runs on {device}"
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            return (
                f"{what} must be contiguous {dtype} {shape}, got "
                f"{t.dtype} {tuple(t.shape)} (contiguous: {t.is_contiguous()})"
            )
        if t.data_ptr() % POINTER_ALIGN_BYTES:
            return f"{what} at address {t.data_ptr():#x} is not {POINTER_ALIGN_BYTES}-byte aligned"
    if len({t.data_ptr() for t in tensors}) != len(tensors):
        return f"two rows share one {what}"
    return None


def int64_on_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``; to a GPU from pinned memory without a host
    sync (the caching host allocator keeps the buffer until the copy is done)."""
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
