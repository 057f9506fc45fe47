"""The prefix cache's tree (rank 0) and each rank's store of what its nodes hold, without a model:

- matching at block granularity, resumable only at the end of a node with a snapshot, capped by
  the request's limit; insertion that splits a node where a new branch leaves it (the snapshot
  stays at the node's end) and takes only the blocks the tree lacked;
- locks pin a running request's path; eviction drops unlocked leaves, those without a snapshot
  first, least recently used first, and frees a parent that became a leaf; snapshots have their
  own budget (the least recently used makes way);
- the ops the tree emits, applied by a rank's :class:`PrefixStore` over a real block pool and
  state tensors: the node blocks hold references (a finished request's blocks survive its free),
  a hit adopts the path's blocks and loads the snapshot bit for bit, and after a flush every
  block, snapshot row and node is back.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.prefix_store import PrefixStore
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.radix_ops import (
    DropNode,
    DropSnapshot,
    InsertNode,
    PrefixHit,
    SaveSnapshot,
    SplitNode,
)
from sglang.srt.mem_cache.slot_blocks import SlotBlocks, SlotPoolSize
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=2)

B = 4  # tokens a block


def _seq(*blocks: int) -> list[int]:
    """Tokens of whole blocks, block ``k`` being ``[k, k, k, k]``."""
    return [b for b in blocks for _ in range(B)]


def test_match_is_by_whole_blocks_and_resumes_only_at_snapshots() -> None:
    tree = RadixCache(B, snapshot_rows=4)
    a = tree.insert(_seq(1, 2, 3), "a", held=None, snapshot=True)
    assert a.new_blocks == 3 and a.saved_now
    assert tree.take_ops() == (InsertNode(a.node.id, "a", 0, 3), SaveSnapshot(a.node.id, "a"))
    m = tree.match(_seq(1, 2, 3, 4), limit=16)
    assert (m.cached_tokens, m.matched_tokens) == (12, 12) and m.nodes == (a.node,)
    m = tree.match(_seq(1, 2, 3), limit=11)  # the last prompt token is always computed
    assert (m.cached_tokens, m.matched_tokens) == (0, 8) and m.hit("x") is None
    m = tree.match(_seq(1, 2, 9), limit=12)  # diverges in the third block
    assert (m.cached_tokens, m.matched_tokens) == (0, 8)
    m = tree.match(_seq(1, 2, 3)[:-1] + [7], limit=16)  # ... or at its last token
    assert (m.cached_tokens, m.matched_tokens) == (0, 8)
    hit = tree.match(_seq(1, 2, 3, 5), limit=15).hit("b")
    assert hit == PrefixHit("b", (a.node.id,), 12)


def test_insert_continues_the_held_path_from_its_end() -> None:
    tree = RadixCache(B, snapshot_rows=4)
    a = tree.insert(_seq(1, 2), "a", held=None, snapshot=False)
    with pytest.raises(ValueError, match="whole blocks"):
        tree.insert(_seq(3), "a", held=a.node, start=0, snapshot=False)  # held ends at 8
    more = tree.insert(_seq(3, 4), "a", held=a.node, start=8, snapshot=True)
    assert more.node.parent is a.node and more.new_blocks == 2
    assert tree.take_ops()[-2:] == (
        InsertNode(more.node.id, "a", 2, 2),
        SaveSnapshot(more.node.id, "a"),
    )
    assert tree.match(_seq(1, 2, 3, 4, 5), limit=20).cached_tokens == 16
    assert a.node.lock == 1 and more.node.lock == 1  # the lock moved down the path


def test_a_branch_splits_the_node_and_the_snapshot_stays_at_its_end() -> None:
    tree = RadixCache(B, snapshot_rows=4)
    a = tree.insert(_seq(1, 2, 3), "a", held=None, snapshot=True)
    tree.take_ops()
    # "b" recomputed blocks 1, 2 (its own copies stay its own) and diverges after them.
    b = tree.insert(_seq(1, 2), "b", held=None, snapshot=True)
    head = b.node
    assert b.new_blocks == 0 and b.saved_now and head is not a.node
    assert head.key == tuple(_seq(1, 2)) and a.node.parent is head and a.node.snapshot
    assert tree.take_ops() == (SplitNode(a.node.id, head.id, 2), SaveSnapshot(head.id, "b"))
    c = tree.insert(_seq(8, 9), "c", held=head, start=8, snapshot=False)  # continues "b"'s path
    assert c.new_blocks == 2 and not c.saved_now and c.node.parent is head
    assert tree.take_ops() == (InsertNode(c.node.id, "c", 2, 2),)
    assert tree.num_blocks == 5 and tree.num_snapshots == 2
    m = tree.match(_seq(1, 2, 8, 9, 9), limit=20)
    assert (m.cached_tokens, m.matched_tokens) == (8, 16) and m.nodes == (head,)


def test_locks_pin_paths_and_eviction_order() -> None:
    tree = RadixCache(B, snapshot_rows=8)
    base = tree.insert(_seq(1, 2), "r", held=None, snapshot=True).node
    left = tree.insert(_seq(3), "r", held=base, start=8, snapshot=False).node  # no snapshot
    right = tree.insert(_seq(1, 2, 4), "s", held=None, snapshot=True).node
    tree.unlock(left)
    tree.unlock(right)
    tree.take_ops()
    assert tree.evictable_blocks == tree.num_blocks == 4
    tree.lock(right)  # a running request on [1, 2, 4]: its path is pinned
    assert tree.evictable_blocks == 1  # only "left"
    assert tree.evict(1) == 1 and tree.take_ops() == (DropNode(left.id),)
    assert tree.evict(5) == 0  # the rest is pinned
    tree.unlock(right)
    # leaves without a snapshot go first; then least recently used; a parent left as a leaf follows
    assert tree.evict(10) == 3
    assert tree.take_ops() == (DropNode(right.id), DropNode(base.id))
    assert tree.num_blocks == tree.evictable_blocks == tree.num_snapshots == 0
    assert tree.evicted_blocks == 4 and tree.evicted_snapshots == 2
    with pytest.raises(RuntimeError, match="unlocked more often"):
        tree.unlock(right)


def test_snapshot_budget_drops_the_least_recently_used() -> None:
    tree = RadixCache(B, snapshot_rows=2)
    one = tree.insert(_seq(1), "a", held=None, snapshot=True).node
    two = tree.insert(_seq(2), "b", held=None, snapshot=True).node
    tree.match(_seq(1, 5), limit=8)  # matching does not count as use
    tree.lock(one)  # a hit on "one" does
    three = tree.insert(_seq(3), "c", held=None, snapshot=True)
    assert three.saved_now and not two.snapshot and one.snapshot
    ops = tree.take_ops()
    assert ops[-2:] == (DropSnapshot(two.id), SaveSnapshot(three.node.id, "c"))
    assert tree.num_snapshots == 2 and tree.evicted_snapshots == 1


def test_a_snapshot_with_a_deeper_one_below_goes_first() -> None:
    tree = RadixCache(B, snapshot_rows=3)
    old = tree.insert(_seq(5), "c", held=None, snapshot=True).node
    head = tree.insert(_seq(1), "a", held=None, snapshot=True).node
    deep = tree.insert(_seq(2), "a", held=head, start=4, snapshot=True).node
    assert old.last_used < head.last_used  # "old" is the least recently used ...
    tree.insert(_seq(7), "d", held=None, snapshot=True)
    # ... but a request extending [1] resumes at [1, 2]: the snapshot at [1] is the one to drop
    assert not head.snapshot and old.snapshot and deep.snapshot


class _Pool(SlotBlocks):
    """Two per-slot state tensors (one bf16, one fp32) and the block bookkeeping."""

    def __init__(self) -> None:
        super().__init__(SlotPoolSize(3, 64, block_tokens=B), device=torch.device("cpu"))
        self.window = torch.zeros(self.rows, 3, 5, dtype=torch.bfloat16)
        self.state = torch.zeros(self.rows, 2, 2)

    def edge_state(self) -> list[torch.Tensor]:
        return [self.window, self.state]


class _Cache:
    def __init__(self, slot: int) -> None:
        self.slot: int | None = slot
        self.num_tokens = 0

    def resume_at(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens


def test_the_ranks_store_follows_the_ops_and_a_flush_returns_everything() -> None:
    pool, tree = _Pool(), RadixCache(B, snapshot_rows=2)
    store = PrefixStore(pool, snapshot_rows=2)
    blocks = pool.block_pool
    a = _Cache(pool.alloc())
    pool.reserve(a.slot, 13)  # 4 blocks
    pool.window[a.slot] = torch.randn(3, 5).to(torch.bfloat16)
    pool.state[a.slot] = torch.randn(2, 2)
    want = (pool.window[a.slot].clone(), pool.state[a.slot].clone())
    done = tree.insert(_seq(1, 2, 3), "a", held=None, snapshot=True)
    store.apply(tree.take_ops(), {"a": a})
    own = pool.blocks.blocks(a.slot).table
    assert store.node_blocks[done.node.id] == own[:3]
    assert [blocks.holders(b) for b in own] == [2, 2, 2, 1]
    tree.unlock(done.node)
    pool.free(a.slot)  # "a" finished: the tree keeps its three blocks
    assert blocks.num_free == blocks.num_blocks - 3
    b = _Cache(pool.alloc())
    hit = tree.match(_seq(1, 2, 3, 4), limit=15).hit("b")
    assert hit is not None
    store.attach(hit, b)
    assert b.num_tokens == 12 and pool.blocks.blocks(b.slot).table == own[:3]
    assert torch.equal(pool.window[b.slot], want[0]) and torch.equal(pool.state[b.slot], want[1])
    assert pool.blocks.table[b.slot, :3].tolist() == own[:3]
    pool.reserve(b.slot, 16)  # its own tokens start in a block of its own
    assert pool.blocks.blocks(b.slot).table[3] not in own[:3]
    pool.free(b.slot)
    assert tree.flush() == 3 and tree.evicted_blocks == 0  # a flush is no eviction
    store.apply(tree.take_ops(), {})
    assert blocks.num_free == blocks.num_blocks and store.snapshots.num_free == 2
    assert not store.node_blocks and not store.node_snapshot and tree.num_blocks == 0
    with pytest.raises(ValueError, match="node 99 is not held"):
        store.apply((SplitNode(99, 98, 1),), {})


if __name__ == "__main__":
    run_this_file(__file__)
