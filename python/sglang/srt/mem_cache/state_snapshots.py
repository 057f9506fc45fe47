"""Copies of requests' fixed-size state at block edges: what the prefix cache keeps beside the
shared blocks so another request can resume exactly there.

A slot pool names the per-slot tensors of that state (:meth:`SlotBlocks.edge_state`: DeepSeek V4's
window rings and overlap rows, Kimi K3's KDA conv and recurrent states); this store allocates the
same tensors with ``rows`` snapshot rows (same dtype and device: whatever the pool holds, FP8 or
not, is copied byte for byte) and copies one slot's rows in (:meth:`save`) or back into a slot
(:meth:`load`). Rows are handed out lowest first; the caller (the prefix store) frees them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SnapshotsFullError(RuntimeError):
    """Every snapshot row is taken; the prefix cache evicts one before it saves another."""


class StateSnapshots:
    def __init__(self, slot_state: Sequence[torch.Tensor], rows: int) -> None:
        if rows < 1:
            raise ValueError(f"a snapshot store needs >= 1 row, got {rows}")
        self.slot_state = list(slot_state)
        self.rows = rows
        self.copies = [
            torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
            for t in self.slot_state
        ]
        self._free = list(range(rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copies)

    def row_bytes(self) -> int:
        """One snapshot's bytes."""
        return self.nbytes() // self.rows

    def save(self, slot: int) -> int:
        """Copy ``slot``'s state into a free row; returns the row."""
        if not self._free:
            raise SnapshotsFullError(f"all {self.rows} state snapshot rows are in use")
        row = self._free.pop()
        for state, copy in zip(self.slot_state, self.copies):
            copy[row].copy_(state[slot])
        return row

    def load(self, row: int, slot: int) -> None:
        """Copy snapshot ``row`` into ``slot``'s state."""
        self._check(row)
        for state, copy in zip(self.slot_state, self.copies):
            state[slot].copy_(copy[row])

    def release(self, row: int) -> None:
        self._check(row)
        self._free.append(row)

    def _check(self, row: int) -> None:
        if not 0 <= row < self.rows or row in self._free:
            raise ValueError(f"snapshot row {row} is not a taken row of this store")
