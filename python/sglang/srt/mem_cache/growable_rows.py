"""An append-only ``[n, dim]`` tensor with amortised O(1) appends (capacity doubling): the
compressed KV entries and indexer keys of one request and layer, which grow without bound."""

from __future__ import annotations

import torch


class GrowableRows:
    def __init__(
        self,
        dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        capacity: int = 16,
    ) -> None:
        self.buf = torch.empty(max(capacity, 1), dim, dtype=dtype, device=device)
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def rows(self) -> torch.Tensor:
        return self.buf[: self.n]

    def append(self, rows: torch.Tensor) -> None:
        m = rows.shape[0]
        if m == 0:
            return
        need = self.n + m
        if need > self.buf.shape[0]:
            self._grow(need)
        self.buf[self.n : need] = rows.to(self.buf.dtype)
        self.n = need

    def _grow(self, need: int) -> None:
        cap = self.buf.shape[0]
        while cap < need:
            cap *= 2
        grown = torch.empty(cap, self.buf.shape[1], dtype=self.buf.dtype, device=self.buf.device)
        grown[: self.n] = self.buf[: self.n]
        self.buf = grown
