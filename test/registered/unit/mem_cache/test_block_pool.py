"""The cache block pool: allocation, growth with the live length, free and reuse, exhaustion
(all-or-nothing, the caller waits), and admission by free blocks against whole-context slots."""

from __future__ import annotations

import random

import pytest

from sglang.srt.mem_cache.block_admission import admit, block_concurrency, slot_concurrency
from sglang.srt.mem_cache.block_pool import BlockPool, BlockPoolExhausted, RequestBlocks
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=2)


def test_alloc_free_reuse_lowest_first() -> None:
    pool = BlockPool(8, 16)
    a, b = pool.alloc(3), pool.alloc(2)
    assert (a, b, pool.num_free) == ([0, 1, 2], [3, 4], 3)
    pool.free(a)
    assert pool.alloc(2) == [0, 1] and pool.num_free == 4
    with pytest.raises(ValueError):
        pool.free(a)  # block 2 is free already, 0 and 1 were reused: a is not one allocation
    with pytest.raises(ValueError):
        pool.free([7])


def test_exhaustion_is_all_or_nothing() -> None:
    pool = BlockPool(4, 8)
    req = RequestBlocks(pool)
    req.ensure(20)  # 3 blocks
    other = RequestBlocks(pool)
    with pytest.raises(BlockPoolExhausted):
        other.ensure(9)  # needs 2, 1 free
    assert other.table == [] and pool.num_free == 1
    req.release()
    assert other.ensure(9) == [0, 1] and pool.num_free == 2


def test_table_grows_with_live_length() -> None:
    pool = BlockPool(16, 4)
    req = RequestBlocks(pool)
    grown = [len(req.ensure(n)) for n in range(1, 18)]
    assert sum(grown) == 5 and req.capacity == 20  # 17 tokens -> 5 blocks of 4
    assert grown[0] == 1 and grown[3] == 0 and grown[4] == 1


def test_scheduler_waits_for_blocks_and_finishes_everything() -> None:
    # A queue of requests of random lengths over a small pool: each is admitted only when its
    # reservation fits the free blocks, runs a while, frees; none is ever refused for good.
    rng = random.Random(0)
    pool = BlockPool(32, 16)
    waiting = [rng.randint(1, 200) for _ in range(60)]
    running: list[tuple[RequestBlocks, int]] = []
    done, steps, peak = 0, 0, 0
    while waiting or running:
        steps += 1
        while waiting and admit(pool, waiting[0]):
            req = RequestBlocks(pool)
            req.ensure(waiting.pop(0))
            running.append((req, rng.randint(1, 5)))
        peak = max(peak, len(running))
        assert running, "the head of the queue must fit an empty pool"
        left = []
        for req, ttl in running:
            if ttl == 1:
                req.release()
                done += 1
            else:
                left.append((req, ttl - 1))
        running = left
    assert done == 60 and pool.num_free == 32 and peak > 2


def test_block_admission_beats_whole_context_slots() -> None:
    total = 1_000_000
    assert slot_concurrency(total, 65536, 256) == 15
    assert block_concurrency(total, 8192, 64, 256) == 122
    assert block_concurrency(total, 8192 + 1, 64, 256) == 121  # one token more: one block more


if __name__ == "__main__":
    run_this_file(__file__)
