"""Fixed-shape reads and writes of paged rows for many requests at once (the static decode):
device tensors in, no host sync, no data-dependent size.

``store [num_blocks + 1, R, D]`` holds ``R`` rows a block; ``table [S, max_blocks]`` lists each
slot's blocks (the null block past them). Row ``j`` of slot ``s`` is
``store[table[s, j // R], j % R]``.
"""

from __future__ import annotations

import torch


def gather_slot_rows(store: torch.Tensor, table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Every row the tables of ``slots [bs]`` reach: ``[bs, max_blocks * R, D]`` (rows past a
    request's length are garbage of the null block or of its own blocks; callers mask them)."""
    rows = store[table[slots]]  # [bs, max_blocks, R, D]
    return rows.reshape(slots.shape[0], -1, store.shape[-1])


def row_address(
    table: torch.Tensor, slots: torch.Tensor, row: torch.Tensor, rows_per_block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block, offset)`` of row ``row [bs]`` of each slot in ``slots [bs]``."""
    block = table[slots, torch.div(row, rows_per_block, rounding_mode="floor")]
    return block, row % rows_per_block
