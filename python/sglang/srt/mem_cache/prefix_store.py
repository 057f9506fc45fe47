"""One rank's side of the prefix cache: the blocks and state snapshots each node of rank 0's tree
holds, over the slot pool, changed only by the plan's :mod:`radix_ops` (so every rank holds the
same) and read when a new request starts from a cached prefix.

A node holds a reference to each of its blocks (:meth:`BlockPool.share`), so a request that
finishes leaves the blocks the tree keeps, and a request that starts from them holds them too
(its table adopts them; its own tokens start in a block of its own, since prefixes are whole
blocks). A node's snapshot is a row of :class:`StateSnapshots`: the request's fixed-size state at
the node's end (window rings / KDA states), copied into the new request's slot on a hit; the
request's host counters then resume at the prefix's length (``resume_at``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from sglang.srt.mem_cache.radix_ops import (
    CacheOp,
    DropNode,
    DropSnapshot,
    InsertNode,
    PrefixHit,
    SaveSnapshot,
    SplitNode,
)
from sglang.srt.mem_cache.slot_blocks import SlotBlocks
from sglang.srt.mem_cache.state_snapshots import StateSnapshots


class SlotCache(Protocol):
    """A request cache in a slot of the pool (DeepSeek V4's or Kimi K3's)."""

    slot: int | None

    def resume_at(self, num_tokens: int) -> None:
        """The slot now holds the state after ``num_tokens`` tokens: set the host counters."""


class PrefixStore:
    def __init__(self, pool: SlotBlocks, snapshot_rows: int) -> None:
        self.pool = pool
        self.snapshots = StateSnapshots(pool.edge_state(), snapshot_rows)
        self.node_blocks: dict[int, list[int]] = {}
        self.node_snapshot: dict[int, int] = {}

    def nbytes(self) -> int:
        return self.snapshots.nbytes()

    @property
    def num_blocks(self) -> int:
        """Blocks the nodes hold (a block shared with running requests counts once here)."""
        return sum(len(b) for b in self.node_blocks.values())

    def apply(self, ops: tuple[CacheOp, ...], caches: Mapping[str, SlotCache]) -> None:
        for op in ops:
            if isinstance(op, InsertNode):
                self._insert(op, caches[op.rid])
            elif isinstance(op, SplitNode):
                blocks = self._blocks_of(op.node)
                if not 0 < op.num_blocks < len(blocks) or op.head in self.node_blocks:
                    raise ValueError(f"cannot split node {op.node} ({len(blocks)} blocks): {op}")
                self.node_blocks[op.head] = blocks[: op.num_blocks]
                self.node_blocks[op.node] = blocks[op.num_blocks :]
            elif isinstance(op, SaveSnapshot):
                if op.node not in self.node_blocks or op.node in self.node_snapshot:
                    raise ValueError(f"node {op.node} cannot take a snapshot: {op}")
                self.node_snapshot[op.node] = self.snapshots.save(self._slot(caches[op.rid]))
            elif isinstance(op, DropSnapshot):
                self.snapshots.release(self.node_snapshot.pop(op.node))
            elif isinstance(op, DropNode):
                self.pool.block_pool.free(self._blocks_of(op.node))
                del self.node_blocks[op.node]
                row = self.node_snapshot.pop(op.node, None)
                if row is not None:
                    self.snapshots.release(row)
            else:
                raise TypeError(f"unknown prefix-cache op {op!r}")

    def attach(self, hit: PrefixHit, cache: SlotCache) -> None:
        """Start ``cache`` (new, empty) from the cached prefix: its table adopts the path's blocks
        and its slot takes the last node's snapshot."""
        blocks = [b for node in hit.nodes for b in self._blocks_of(node)]
        if len(blocks) * self.pool.block_tokens != hit.tokens:
            raise ValueError(
                f"prefix hit of {hit.tokens} tokens, but its nodes hold {len(blocks)} blocks of "
                f"{self.pool.block_tokens}"
            )
        slot = self._slot(cache)
        self.pool.blocks.adopt(slot, blocks)
        self.snapshots.load(self.node_snapshot[hit.nodes[-1]], slot)
        cache.resume_at(hit.tokens)

    def _insert(self, op: InsertNode, cache: SlotCache) -> None:
        if op.node in self.node_blocks:
            raise ValueError(f"node {op.node} exists already: {op}")
        table = self.pool.blocks.blocks(self._slot(cache)).table
        blocks = table[op.first_block : op.first_block + op.num_blocks]
        if op.num_blocks < 1 or len(blocks) != op.num_blocks:
            raise ValueError(f"{op.rid} holds {len(table)} blocks, cannot give {op}")
        self.pool.block_pool.share(blocks)
        self.node_blocks[op.node] = blocks

    def _blocks_of(self, node: int) -> list[int]:
        blocks = self.node_blocks.get(node)
        if blocks is None:
            raise ValueError(f"node {node} is not held by this rank's prefix store")
        return blocks

    @staticmethod
    def _slot(cache: SlotCache) -> int:
        if cache.slot is None:
            raise ValueError("the prefix cache needs pooled request caches")
        return cache.slot
