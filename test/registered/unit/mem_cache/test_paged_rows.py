"""Append-only paged row buffers: PagedRows writes and reads one request's rows in the blocks its
device table row lists (across block edges, never into another request's blocks), and refuses
rows it holds no block for."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.block_pool import BlockPool, BlockPoolExhausted
from sglang.srt.mem_cache.paged_block_table import PagedBlockTable
from sglang.srt.mem_cache.paged_rows import PagedRows
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=0.5)


def test_paged_rows_cross_block_edges_through_the_table() -> None:
    pool = BlockPool(num_blocks=5, block_tokens=4)
    table = PagedBlockTable(pool, rows=2, max_tokens=16)
    store = torch.zeros(pool.num_blocks + 1, 4, 3)  # 4 rows a block (ratio 1)
    other = PagedRows(store, table.table[0], table.blocks(0))
    table.ensure(0, 3)  # row 0 takes block 0, so row 1's blocks are not 0, 1, 2
    rows = PagedRows(store, table.table[1], table.blocks(1))
    data = torch.randn(11, 3)
    with pytest.raises(RuntimeError, match="holds blocks for 0"):
        rows.append(data[:1])  # no block reserved yet
    table.ensure(1, 5)
    rows.append(data[:5])  # spans blocks 0 and 1 of row 1
    table.ensure(1, 11)
    rows.append(data[5:11])
    assert torch.equal(rows.rows(), data) and len(rows) == 11
    assert table.blocks(1).table == [1, 2, 3] and table.table[1].tolist() == [1, 2, 3, 5]
    assert len(other.rows()) == 0 and bool((store[0] == 0).all())  # row 0's block untouched
    with pytest.raises(RuntimeError, match="exceeds the per-request capacity 16"):
        table.ensure(1, 17)
    with pytest.raises(BlockPoolExhausted):
        table.ensure(0, 16)  # 3 more blocks asked, 1 free: none taken
    assert table.blocks(0).table == [0] and pool.num_free == 1
    table.release(1)
    table.release(0)
    assert pool.num_free == 5 and bool((table.table == table.null_block).all())


def test_paged_rows_need_a_3d_store() -> None:
    pool = BlockPool(num_blocks=1, block_tokens=4)
    table = PagedBlockTable(pool, rows=1, max_tokens=4)
    with pytest.raises(ValueError, match="PagedRows needs a \\[blocks, rows, dim\\] store"):
        PagedRows(torch.zeros(4, 3), table.table[0], table.blocks(0))


if __name__ == "__main__":
    run_this_file(__file__)
