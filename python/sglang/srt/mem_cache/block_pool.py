"""A pool of fixed-size cache blocks: what paged request state allocates from.

A request holds ``ceil(live tokens / block_tokens)`` blocks of its per-token state (compressed
entries, indexer keys) through a :class:`RequestBlocks` table that grows as it decodes and
returns every block when it finishes, so memory follows live lengths instead of whole-context
slots. Allocation is all or nothing: a request that cannot get its blocks gets none, and the
caller (the scheduler) waits for blocks to come back instead of failing. Lowest free block first,
so reuse stays predictable.

A block may be held more than once: the prefix cache (``radix_cache.py``) holds the blocks of
the prefixes it keeps, and a request that starts from a cached prefix holds them too. Each holder
takes a reference (:meth:`BlockPool.share`) and gives it back with :meth:`BlockPool.free`; a block
returns to the free list when its last holder lets go.

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
        self._refs: dict[int, int] = {}  # allocated block -> its holders

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
        for b in got:
            self._refs[b] = 1
        return got

    def share(self, blocks: list[int]) -> None:
        """One more holder of each of ``blocks`` (allocated blocks)."""
        self._check_held(blocks)
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """One holder fewer of each of ``blocks``; a block nobody holds is free again."""
        self._check_held(blocks)
        for b in blocks:
            left = self._refs[b] - 1
            if left:
                self._refs[b] = left
            else:
                del self._refs[b]
                heapq.heappush(self._free, b)

    def holders(self, block: int) -> int:
        """How many holders ``block`` has (0: free)."""
        return self._refs.get(block, 0)

    def _check_held(self, blocks: list[int]) -> None:
        bad = [b for b in blocks if b not in self._refs]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks {bad or blocks} are not allocated blocks of this pool")


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

    def adopt(self, blocks: list[int]) -> None:
        """Start an empty table with ``blocks`` that others hold too (a cached prefix): this
        table becomes one more holder of each."""
        if self.table:
            raise RuntimeError("a cached prefix can only start an empty block table")
        self.pool.share(blocks)
        self.table = list(blocks)

    def release(self) -> None:
        self.pool.free(self.table)
        self.table = []
