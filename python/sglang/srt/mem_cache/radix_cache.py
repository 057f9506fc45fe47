"""The prefix cache's tree (rank 0): a radix tree over token ids at the block granularity of the
paged pools, which decides what the ranks keep (``radix_ops.py``, applied by each rank's
``prefix_store.py``).

A node holds whole blocks of ``block_tokens`` tokens (its ``key``); a path from the root spells a
cached prefix. Blocks alone are not a resumable state for these models: DeepSeek V4 also needs
the window rings and the overlap rows at the point it resumes from, Kimi K3 the KDA states. So a
node may also hold a *snapshot* of that state at its end, and a prefix is resumable exactly at
the end of a node with a snapshot: :meth:`RadixCache.match` returns the deepest such node within
the request's limit (``cached_tokens``), and how far the blocks alone match (``matched_tokens``,
where a snapshot would pay off: the scheduler ends a prefill chunk there and saves one).

Reference counts: a running request locks its deepest node, which pins the whole path (its
blocks are in the request's table). Unlocked nodes are evictable: leaves first, those without a
snapshot before those with one, least recently used first (:meth:`evict`). Snapshots have their
own budget (``snapshot_rows``); saving one past it drops the least recently used snapshot.
Every change is queued as an op for the next plan (:meth:`take_ops`), in the order it was made.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from sglang.srt.mem_cache.radix_ops import (
    CacheOp,
    DropNode,
    DropSnapshot,
    InsertNode,
    PrefixHit,
    SaveSnapshot,
    SplitNode,
)


@dataclass(eq=False)
class RadixNode:
    id: int
    parent: RadixNode | None
    key: tuple[int, ...]  # this node's tokens: whole blocks
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock: int = 0  # running requests whose path goes through this node
    last_used: int = 0
    snapshot: bool = False
    hits: int = 0  # requests that resumed from its snapshot


@dataclass(frozen=True)
class PrefixMatch:
    """``nodes``: the path (root's child first) to the deepest node with a snapshot within the
    limit, whose end is ``cached_tokens`` (0 and no nodes: nothing resumable); ``matched_tokens``:
    how many tokens whole blocks of the tree match (>= ``cached_tokens``)."""

    nodes: tuple[RadixNode, ...]
    cached_tokens: int
    matched_tokens: int

    def hit(self, rid: str) -> PrefixHit | None:
        if not self.nodes:
            return None
        return PrefixHit(rid, tuple(n.id for n in self.nodes), self.cached_tokens)


@dataclass(frozen=True)
class Inserted:
    """What :meth:`RadixCache.insert` did: the node ending at the inserted length (now locked
    for the request), the request's blocks the tree took over, and whether it saved the node's
    snapshot from the request now."""

    node: RadixNode
    new_blocks: int
    saved_now: bool


class RadixCache:
    def __init__(self, block_tokens: int, snapshot_rows: int) -> None:
        if block_tokens < 1 or snapshot_rows < 1:
            raise ValueError(
                f"radix cache needs >= 1 block token and snapshot row, got {block_tokens}, "
                f"{snapshot_rows}"
            )
        self.block_tokens = block_tokens
        self.snapshot_rows = snapshot_rows
        self._ids = itertools.count(1)
        self.root = RadixNode(0, None, ())
        self._clock = itertools.count(1)
        self._ops: list[CacheOp] = []
        self.num_blocks = 0  # blocks the nodes hold
        self.evictable_blocks = 0  # of those, in unlocked nodes
        self.num_snapshots = 0
        self.evicted_blocks = 0  # totals, for metrics
        self.evicted_snapshots = 0

    # --- matching --------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], limit: int) -> PrefixMatch:
        """The longest cached prefix of ``tokens[:limit]`` (no change to the tree)."""
        b = self.block_tokens
        limit = min(limit, len(tokens)) // b * b
        node, pos = self.root, 0
        path: list[RadixNode] = []
        best: tuple[RadixNode, ...] = ()
        cached = 0
        while pos < limit:
            child = node.children.get(tuple(tokens[pos : pos + b]))
            if child is None:
                break
            same = self._common_blocks(child.key, tokens, pos, limit)
            if same * b < len(child.key):
                return PrefixMatch(best, cached, pos + same * b)
            pos += len(child.key)
            path.append(child)
            if child.snapshot:
                best, cached = tuple(path), pos
            node = child
        return PrefixMatch(best, cached, pos)

    def _common_blocks(
        self, key: tuple[int, ...], tokens: Sequence[int], pos: int, limit: int
    ) -> int:
        b = self.block_tokens
        n = min(len(key), limit - pos) // b
        for i in range(n):
            if key[i * b : (i + 1) * b] != tuple(tokens[pos + i * b : pos + (i + 1) * b]):
                return i
        return n

    # --- locks -----------------------------------------------------------------------------------

    def lock(self, node: RadixNode | None) -> None:
        """A running request's path goes through ``node`` (None: the root, nothing to pin)."""
        now = next(self._clock)
        while node is not None and node is not self.root:
            if node.lock == 0:
                self.evictable_blocks -= self._blocks(node)
            node.lock += 1
            node.last_used = now
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        while node is not None and node is not self.root:
            node.lock -= 1
            if node.lock < 0:
                raise RuntimeError(f"radix node {node.id} unlocked more often than locked")
            if node.lock == 0:
                self.evictable_blocks += self._blocks(node)
            node = node.parent

    # --- insertion -------------------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        rid: str,
        *,
        held: RadixNode | None,
        snapshot: bool,
        start: int = 0,
    ) -> Inserted:
        """Cache ``tokens`` (whole blocks), which continue the path ``rid`` holds: the node
        ``held`` ending at ``start`` (None: the root, ``start`` 0). Nodes for the part the tree
        lacks take ``rid``'s blocks there, and with ``snapshot`` the node ending after ``tokens``
        takes a copy of ``rid``'s state (if it has none and a snapshot row can be freed). The
        request's lock moves from ``held`` to that node. Only the new tokens are walked."""
        b = self.block_tokens
        if len(tokens) % b or not tokens or start % b or (held is None) != (start == 0):
            raise ValueError(
                f"the tree caches whole blocks of {b} tokens after the held node's end, got "
                f"{len(tokens)} tokens from {start}"
            )
        node, pos, new_blocks = held or self.root, 0, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + b]))
            if child is None:
                child = self._new_node(node, tuple(tokens[pos:]))
                new_blocks = self._blocks(child)
                self._ops.append(InsertNode(child.id, rid, (start + pos) // b, new_blocks))
                pos = len(tokens)
            else:
                same = self._common_blocks(child.key, tokens, pos, len(tokens))
                if same * b < len(child.key):
                    child = self._split(child, same)
                pos += len(child.key)
            child.last_used = now
            node = child
        saved_now = snapshot and not node.snapshot and self._free_snapshot_row()
        if saved_now:
            self._ops.append(SaveSnapshot(node.id, rid))
            node.snapshot = True
            self.num_snapshots += 1
        self.lock(node)
        self.unlock(held)
        return Inserted(node, new_blocks, saved_now)

    def drop_snapshot(self, node: RadixNode) -> None:
        """Let go of ``node``'s snapshot (its blocks stay)."""
        if node.snapshot:
            node.snapshot = False
            self.num_snapshots -= 1
            self._ops.append(DropSnapshot(node.id))

    def _new_node(self, parent: RadixNode, key: tuple[int, ...]) -> RadixNode:
        node = RadixNode(next(self._ids), parent, key)
        parent.children[key[: self.block_tokens]] = node
        self.num_blocks += self._blocks(node)
        self.evictable_blocks += self._blocks(node)
        return node

    def _split(self, node: RadixNode, blocks: int) -> RadixNode:
        """``node``'s first ``blocks`` blocks become a new parent node (returned); ``node`` keeps
        the rest, its children and its snapshot. Locks and use carry over to the head."""
        b = self.block_tokens
        parent = node.parent
        assert parent is not None and 0 < blocks * b < len(node.key)
        head = RadixNode(
            next(self._ids),
            parent,
            node.key[: blocks * b],
            lock=node.lock,
            last_used=node.last_used,
        )
        parent.children[head.key[:b]] = head
        node.key = node.key[blocks * b :]
        node.parent = head
        head.children[node.key[:b]] = node
        self._ops.append(SplitNode(node.id, head.id, blocks))
        return head

    # --- eviction --------------------------------------------------------------------------------

    def evict(self, blocks: int) -> int:
        """Drop unlocked nodes (leaves first; no snapshot before snapshot; least recently used
        first) until ``blocks`` blocks are freed or none is left; returns the blocks freed."""
        freed, snapshots = self._drop_unlocked(blocks)
        self.evicted_blocks += freed
        self.evicted_snapshots += snapshots
        return freed

    def flush(self) -> int:
        """Drop every unlocked node (all of them when nothing runs); returns the blocks freed
        (not counted as evictions)."""
        return self._drop_unlocked(self.num_blocks)[0]

    def _drop_unlocked(self, blocks: int) -> tuple[int, int]:
        """(blocks, snapshots) dropped to free ``blocks`` blocks, in eviction order."""
        if blocks <= 0:
            return 0, 0
        heap = [self._evict_key(n) for n in self._leaves() if n.lock == 0]
        heapq.heapify(heap)
        freed = snapshots = 0
        while heap and freed < blocks:
            *_, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            snapshots += node.snapshot
            freed += self._drop(node)
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, self._evict_key(parent))
        return freed, snapshots

    def _evict_key(self, node: RadixNode) -> tuple[bool, int, int, RadixNode]:
        return (node.snapshot, node.last_used, node.id, node)

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def _drop(self, node: RadixNode) -> int:
        parent = node.parent
        assert parent is not None and not node.children and node.lock == 0
        del parent.children[node.key[: self.block_tokens]]
        n = self._blocks(node)
        self.num_blocks -= n
        self.evictable_blocks -= n
        if node.snapshot:
            self.num_snapshots -= 1
        self._ops.append(DropNode(node.id))
        node.parent = None
        return n

    def _free_snapshot_row(self) -> bool:
        """A snapshot row is free, or the least recently used snapshot made way (True); False
        when there is no row at all to take."""
        if self.num_snapshots < self.snapshot_rows:
            return True
        covered = self._covered_snapshots()
        held = [n for n in self._nodes() if n.snapshot]
        if not held:
            return False
        self.drop_snapshot(min(held, key=lambda n: (n not in covered, n.last_used, n.id)))
        self.evicted_snapshots += 1
        return True

    def _covered_snapshots(self) -> set[RadixNode]:
        """Snapshot nodes on a single path with another snapshot further along it (a chat's
        earlier turns): a request extending the path resumes there. A node where the tree
        branches is where requests parted before (a shared system prompt): never covered."""
        covered: set[RadixNode] = set()
        holds: dict[RadixNode, bool] = {}  # whether a node's subtree holds a snapshot
        order = self._nodes()  # parents before children: walk it backwards
        for node in reversed(order):
            below = any(holds[c] for c in node.children.values())
            if below and node.snapshot and len(node.children) == 1:
                covered.add(node)
            holds[node] = below or node.snapshot
        return covered

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # --- ops -------------------------------------------------------------------------------------

    def take_ops(self) -> tuple[CacheOp, ...]:
        """The changes since the last call, in order (for the next plan)."""
        ops, self._ops = tuple(self._ops), []
        return ops

    def _blocks(self, node: RadixNode) -> int:
        return len(node.key) // self.block_tokens
