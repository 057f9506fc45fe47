"""A fixed-capacity ring of the most recent rows: the sliding-window KV of one request and layer.

DeepSeek V4 attends to the raw KV of the last ``window`` positions (the query's own included), so a
request keeps the previous ``window - 1`` rows; older rows can never be read again.

Row ``p % capacity`` holds position ``p``. A ring may live in a slot of the static pool (``buf``
given, capacity ``window``): the static decode then reads and writes the same rows by position.
"""

from __future__ import annotations

import torch


class WindowRing:
    def __init__(
        self,
        capacity: int,
        dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        buf: torch.Tensor | None = None,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"window ring capacity must be >= 0, got {capacity}")
        if buf is not None and tuple(buf.shape) != (capacity, dim):
            raise ValueError(f"ring buffer {tuple(buf.shape)} is not [{capacity}, {dim}]")
        self.capacity = capacity
        if buf is None:
            buf = torch.zeros(capacity, dim, dtype=dtype, device=device)
        self.buf = buf
        self.total = 0  # rows ever appended (= the absolute position after the last row)

    def __len__(self) -> int:
        return min(self.total, self.capacity)

    @property
    def first_position(self) -> int:
        """Absolute position of the oldest row held."""
        return self.total - len(self)

    def rows(self) -> torch.Tensor:
        """The held rows, oldest first: ``[len, dim]`` (a copy when the ring has wrapped)."""
        n = len(self)
        if n == 0:
            return self.buf[:0]
        start = self.first_position % self.capacity
        if start + n <= self.capacity:
            return self.buf[start : start + n]
        return torch.cat([self.buf[start:], self.buf[: start + n - self.capacity]])

    def append(self, rows: torch.Tensor) -> None:
        """Append ``rows [m, dim]`` (positions ``total .. total+m-1``)."""
        m = rows.shape[0]
        if self.capacity == 0 or m == 0:
            self.total += m
            return
        keep = rows[-self.capacity :]
        first = self.total + m - keep.shape[0]
        idx = torch.arange(first, first + keep.shape[0], device=self.buf.device) % self.capacity
        self.buf[idx] = keep.to(self.buf.dtype)
        self.total += m
