"""Per-request block tables in device memory over one :class:`BlockPool`: what paged caches (the
DeepSeek V4 slot pool's compressed entries and indexer keys, Kimi K3's MLA latents) read through.

Row ``r`` of ``table [rows, max_blocks]`` (int64 on the device) lists the pool blocks of the
request in row ``r``: block ``i`` holds its tokens ``i * B .. i * B + B - 1``. Entries past a
request's blocks point to the *null block* (``pool.num_blocks``, a block every store allocates
once more and no request owns), so a fixed-shape gather of a whole table row stays in bounds and
reads only masked garbage there: that is what keeps the static decode CUDA-graph safe. The host
copy (:class:`RequestBlocks`) decides; the device row is written only when a block is added.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.block_pool import BlockPool, RequestBlocks


class PagedBlockTable:
    def __init__(
        self, pool: BlockPool, *, rows: int, max_tokens: int, device: torch.device | str = "cpu"
    ) -> None:
        if rows < 1 or max_tokens < 1:
            raise ValueError(f"block table needs >= 1 row and token, got {rows}, {max_tokens}")
        self.pool = pool
        self.max_tokens = max_tokens
        self.max_blocks = pool.blocks_for(max_tokens)
        self.null_block = pool.num_blocks
        self.table = torch.full(
            (rows, self.max_blocks), self.null_block, dtype=torch.long, device=device
        )
        self._rows = [RequestBlocks(pool) for _ in range(rows)]

    @property
    def block_tokens(self) -> int:
        return self.pool.block_tokens

    def blocks(self, row: int) -> RequestBlocks:
        return self._rows[row]

    def ensure(self, row: int, tokens: int) -> None:
        """Give row ``row`` the blocks for ``tokens`` tokens (all or none: raises
        :class:`~sglang.srt.mem_cache.block_pool.BlockPoolExhausted` leaving it as it was)."""
        if tokens > self.max_tokens:
            raise RuntimeError(
                f"a request at {tokens} tokens exceeds the per-request capacity {self.max_tokens}"
            )
        held = self._rows[row]
        start = len(held.table)
        added = held.ensure(tokens)
        if added:
            ids = torch.tensor(added, dtype=torch.long)
            self.table[row, start : start + len(added)] = ids.to(self.table.device)

    def adopt(self, row: int, blocks: list[int]) -> None:
        """Start row ``row`` (empty) with ``blocks`` held elsewhere too: a cached prefix whose
        rows the request reads but never writes (its own tokens start in a block of its own)."""
        if len(blocks) > self.max_blocks:
            raise RuntimeError(
                f"a cached prefix of {len(blocks)} blocks exceeds the per-request capacity "
                f"{self.max_tokens} tokens"
            )
        self._rows[row].adopt(blocks)
        if blocks:
            ids = torch.tensor(blocks, dtype=torch.long)
            self.table[row, : len(blocks)] = ids.to(self.table.device)

    def release(self, row: int) -> None:
        """Return row ``row``'s blocks to the pool and point its table at the null block."""
        held = self._rows[row]
        if held.table:
            self.table[row, : len(held.table)] = self.null_block
            held.release()
