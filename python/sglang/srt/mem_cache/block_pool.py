"""A pool of fixed-size cache blocks: what paged request state allocates from.

A request holds ``ceil(live tokens / block_tokens)`` blocks of its per-token state (compressed
entries, indexer keys) through a :class:`RequestBlocks` table that grows as it decodes and
returns every block when it finishes, so memory follows live lengths instead of whole-context
slots. Allocation is all or nothing: a request that cannot get its blocks gets none, and the
caller (the scheduler) waits for blocks to come back instead of failing. Lowest free block first,
so reuse stays predictable.

This module is the allocator and its accounting; :class:`PagedBlockTable`
(``paged_block_table.py``) mirrors the tables in device memory for the readers.
"""

from __future__ import annotations

import heapq


def blocks_for(tokens: int, block_tokens: int) -> int:
    """Whole blocks that hold ``tokens`` tokens (0 for none)."""
    return -(-max(tokens, 0) // block_tokens)


class BlockPoolExhausted(RuntimeError):
    """Fewer free blocks than asked for; nothing was allocated."""


class BlockPool:
    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks < 1 or block_tokens < 1:
            raise ValueError(
                f"block pool needs >= 1 block and token, got {num_blocks}, {block_tokens}"
            )
        self.num_blocks, self.block_tokens = num_blocks, block_tokens
        self._free = list(range(num_blocks))  # a heap: lowest id first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_tokens)

    def can_allocate(self, blocks: int) -> bool:
        return blocks <= len(self._free)

    def alloc(self, blocks: int) -> list[int]:
        if blocks < 0:
            raise ValueError(f"cannot allocate {blocks} blocks")
        if blocks > len(self._free):
            raise BlockPoolExhausted(f"{blocks} blocks asked, {len(self._free)} free")
        got = [heapq.heappop(self._free) for _ in range(blocks)]
        self._used.update(got)
        return got

    def free(self, blocks: list[int]) -> None:
        bad = [b for b in blocks if b not in self._used]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks {bad or blocks} are not allocated blocks of this pool")
        for b in blocks:
            self._used.remove(b)
            heapq.heappush(self._free, b)


class RequestBlocks:
    """One request's block table: block ``i`` holds its tokens ``i * B .. i * B + B - 1``."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.table: list[int] = []

    @property
    def capacity(self) -> int:
        return len(self.table) * self.pool.block_tokens

    def ensure(self, tokens: int) -> list[int]:
        """Grow the table to hold ``tokens``; returns the blocks added (all or none: raises
        :class:`BlockPoolExhausted` leaving the table as it was)."""
        need = self.pool.blocks_for(tokens) - len(self.table)
        if need <= 0:
            return []
        added = self.pool.alloc(need)
        self.table += added
        return added

    def release(self) -> None:
        self.pool.free(self.table)
        self.table = []
