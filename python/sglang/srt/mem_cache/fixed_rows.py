"""An append-only ``[n, dim]`` view over preallocated rows: the compressed entries or indexer keys
of one request and layer when they live in a slot of the static pool.

Same interface as :class:`GrowableRows` (``rows()``, ``append()``, ``len``, ``buf``), but the
buffer never moves: a CUDA graph baked its address in, so growing would silently detach it.
"""

from __future__ import annotations

import torch


class FixedRows:
    def __init__(self, buf: torch.Tensor) -> None:
        if buf.dim() != 2:
            raise ValueError(f"FixedRows needs a [capacity, dim] buffer, got {tuple(buf.shape)}")
        self.buf = buf
        self.n = 0

    def __len__(self) -> int:
        return self.n

    @property
    def capacity(self) -> int:
        return self.buf.shape[0]

    def rows(self) -> torch.Tensor:
        return self.buf[: self.n]

    def append(self, rows: torch.Tensor) -> None:
        m = rows.shape[0]
        if m == 0:
            return
        need = self.n + m
        if need > self.capacity:
            raise RuntimeError(
                f"slot capacity exceeded: {need} rows needed, {self.capacity} preallocated "
                "(the request is longer than the pool's per-slot token capacity)"
            )
        self.buf[self.n : need] = rows.to(self.buf.dtype)
        self.n = need
