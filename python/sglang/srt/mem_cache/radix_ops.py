"""What the prefix cache's tree (rank 0, ``radix_cache.py``) tells every rank to do with the
blocks and state snapshots it keeps: plain frozen messages carried by the step's plan, applied in
order by each rank's :class:`~sglang.srt.mem_cache.prefix_store.PrefixStore`.

The tree names its nodes by integer ids; a rank keeps, per node, the pool blocks it holds and its
snapshot row, so the ranks agree on what a node holds without sending block ids. A node's blocks
are taken from a running request's block table by position (``InsertNode``); the state snapshot
at a node's end is a copy of a running request's slot (``SaveSnapshot``), taken while that
request's length is the node's end. A new request that starts from a cached prefix is a
:class:`PrefixHit`: the blocks of the nodes on the path, and the last node's snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InsertNode:
    """Node ``node`` holds blocks ``first_block ..`` (``num_blocks`` of them) of ``rid``'s table."""

    node: int
    rid: str
    first_block: int
    num_blocks: int


@dataclass(frozen=True)
class SplitNode:
    """Node ``node``'s first ``num_blocks`` blocks become the new node ``head`` (its parent);
    ``node`` keeps the rest and its snapshot (which is at its end)."""

    node: int
    head: int
    num_blocks: int


@dataclass(frozen=True)
class SaveSnapshot:
    """Node ``node`` keeps a copy of ``rid``'s state now (its length is the node's end)."""

    node: int
    rid: str


@dataclass(frozen=True)
class DropSnapshot:
    node: int


@dataclass(frozen=True)
class DropNode:
    """Node ``node`` lets go of its blocks (and of its snapshot, if it has one)."""

    node: int


CacheOp = InsertNode | SplitNode | SaveSnapshot | DropSnapshot | DropNode


@dataclass(frozen=True)
class PrefixHit:
    """A new request ``rid`` starts from a cached prefix of ``tokens`` tokens: the blocks of
    ``nodes`` (root first, in order) and the snapshot of the last of them."""

    rid: str
    nodes: tuple[int, ...]
    tokens: int

    def __post_init__(self) -> None:
        if not self.nodes or self.tokens < 1:
            raise ValueError(f"a prefix hit needs nodes and tokens, got {self}")
