"""An append-only ``[n, dim]`` view of one request's rows in a paged store: the compressed
entries or indexer keys of one DeepSeek V4 layer, or one Kimi K3 MLA layer's latents.

``store [num_blocks + 1, rows_per_block, dim]`` is shared by every request (one block of the
:class:`PagedBlockTable` holds ``rows_per_block`` rows of this store); row ``j`` of the request
lives in block ``table_row[j // rows_per_block]`` at offset ``j % rows_per_block``. Reads and
writes go through the device table row, so no host sync; the caller gives the request its blocks
(:meth:`PagedBlockTable.ensure`) before rows are appended, and a row past them is an error.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang.srt.mem_cache.block_pool import RequestBlocks
from sglang.srt.mem_cache.growable_rows import GrowableRows
from sglang.srt.mem_cache.row_codec import RowCodec


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

    def append(self, rows: torch.Tensor, encoding: RowCodec | None = None) -> None:
        """Append ``rows``: stored rows as they are, or (``encoding``) values encoded as the
        store holds them (FP8 rows quantised and scattered by one kernel where Triton runs)."""
        m = rows.shape[0]
        if m == 0:
            return
        self.check_room(m)
        block, offset = self._locate(self.n, m)
        if encoding is None:
            self.buf[block, offset] = rows.to(self.buf.dtype)
        else:
            encoding.write(self.flat_store(), block * self.rows_per_block + offset, rows)
        self.n += m

    def flat_store(self) -> torch.Tensor:
        """The whole store as ``[(num_blocks + 1) * rows_per_block, width]`` rows (a view)."""
        return self.buf.view(-1, self.buf.shape[-1])

    def check_room(self, m: int) -> None:
        """The request's reserved blocks hold ``m`` more rows (else a clear error, nothing
        written)."""
        held = len(self.held.table) * self.rows_per_block
        if self.n + m > held:
            raise RuntimeError(
                f"paged rows: {self.n + m} rows needed, the request holds blocks for {held} "
                "(blocks must be reserved before the forward that writes them)"
            )

    def _grow(self, need: int) -> None:
        raise AssertionError("PagedRows never grows its store")


def append_one_each(
    rows: Sequence[PagedRows], new: torch.Tensor, encoding: RowCodec | None = None
) -> None:
    """Append row ``new[i]`` to ``rows[i]`` for every ``i`` (views of one store): a decode step's
    write for many requests as one scatter, instead of a few small kernels per request. The
    target rows come from the host block tables, so the only transfer is their indices.
    ``encoding``: ``new`` holds values to encode as the store holds them (else stored rows)."""
    if not rows:
        return
    store = rows[0].buf
    if new.shape[0] != len(rows) or any(r.buf is not store for r in rows):
        raise ValueError(
            f"append_one_each: {new.shape[0]} new rows for {len(rows)} paged views, which must "
            "all share one store"
        )
    per_block = store.shape[1]
    flat: list[int] = []
    for r in rows:
        r.check_room(1)
        flat.append(r.held.table[r.n // per_block] * per_block + r.n % per_block)
    if len(set(flat)) != len(flat):
        raise ValueError("append_one_each: two views write the same store row")
    idx = torch.tensor(flat, dtype=torch.long).to(store.device, non_blocking=True)
    if encoding is None:
        store.view(-1, store.shape[-1]).index_copy_(0, idx, new.to(store.dtype))
    else:
        encoding.write(rows[0].flat_store(), idx, new)
    for r in rows:
        r.n += 1
