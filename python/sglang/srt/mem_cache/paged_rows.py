"""An append-only ``[n, dim]`` view of one request's rows in a paged store: the compressed
entries or indexer keys of one DeepSeek V4 layer, or one Kimi K3 MLA layer's latents.

``store [num_blocks + 1, rows_per_block, dim]`` is shared by every request (one block of the
:class:`PagedBlockTable` holds ``rows_per_block`` rows of this store); row ``j`` of the request
lives in block ``table_row[j // rows_per_block]`` at offset ``j % rows_per_block``. Reads and
writes go through the device table row, so no host sync; the caller gives the request its blocks
(:meth:`PagedBlockTable.ensure`) before rows are appended, and a row past them is an error.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.block_pool import RequestBlocks
from sglang.srt.mem_cache.growable_rows import GrowableRows


class PagedRows(GrowableRows):
    def __init__(self, store: torch.Tensor, table_row: torch.Tensor, held: RequestBlocks) -> None:
        if store.dim() != 3:
            raise ValueError(f"PagedRows needs a [blocks, rows, dim] store, got {store.shape}")
        self.buf = store  # GrowableRows readers take the dtype from ``buf``
        self.table_row, self.held = table_row, held
        self.rows_per_block = store.shape[1]
        self.n = 0

    def _locate(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.arange(first, first + count, device=self.buf.device)
        return self.table_row[idx // self.rows_per_block], idx % self.rows_per_block

    def rows(self) -> torch.Tensor:
        blocks = -(-self.n // self.rows_per_block)
        flat = self.buf[self.table_row[:blocks]].reshape(-1, self.buf.shape[-1])
        return flat[: self.n]

    def append(self, rows: torch.Tensor) -> None:
        m = rows.shape[0]
        if m == 0:
            return
        held = len(self.held.table) * self.rows_per_block
        if self.n + m > held:
            raise RuntimeError(
                f"paged rows: {self.n + m} rows needed, the request holds blocks for {held} "
                "(blocks must be reserved before the forward that writes them)"
            )
        block, offset = self._locate(self.n, m)
        self.buf[block, offset] = rows.to(self.buf.dtype)
        self.n += m

    def _grow(self, need: int) -> None:
        raise AssertionError("PagedRows never grows its store")
