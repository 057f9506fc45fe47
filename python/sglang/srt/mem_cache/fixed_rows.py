"""An append-only ``[n, dim]`` view over preallocated rows: the compressed entries or indexer keys
of one request and layer when they live in a slot of the static pool.

A :class:`GrowableRows` whose buffer never moves: a CUDA graph baked its address in, so growing
would silently detach it; running out of rows is an error instead.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.growable_rows import GrowableRows


class FixedRows(GrowableRows):
    def __init__(self, buf: torch.Tensor) -> None:
        if buf.dim() != 2:
            raise ValueError(f"FixedRows needs a [capacity, dim] buffer, got {tuple(buf.shape)}")
        self.buf = buf
        self.n = 0

    @property
    def capacity(self) -> int:
        return self.buf.shape[0]

    def _grow(self, need: int) -> None:
        raise RuntimeError(
            f"slot capacity exceeded: {need} rows needed, {self.capacity} preallocated "
            "(the request is longer than the pool's per-slot token capacity)"
        )
