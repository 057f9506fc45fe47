"""Append-only row buffers: GrowableRows grows and keeps what it held; FixedRows never moves its
buffer and refuses to overflow (a CUDA graph holds its address)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.fixed_rows import FixedRows
from sglang.srt.mem_cache.growable_rows import GrowableRows
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=1)


def test_growable_rows_grow_and_keep_contents() -> None:
    rows = GrowableRows(3, dtype=torch.float32, capacity=2)
    data = torch.randn(11, 3)
    rows.append(data[:1])
    rows.append(data[1:1])  # empty append is a no-op
    rows.append(data[1:11])
    assert len(rows) == 11 and rows.buf.shape[0] >= 11
    assert torch.equal(rows.rows(), data)


def test_fixed_rows_stay_in_place_and_refuse_overflow() -> None:
    buf = torch.zeros(4, 2, dtype=torch.bfloat16)
    rows = FixedRows(buf)
    data = torch.randn(5, 2)
    rows.append(data[:3])
    assert rows.buf is buf and rows.capacity == 4
    assert torch.equal(rows.rows(), data[:3].to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="slot capacity exceeded: 5 rows needed, 4 preallocated"):
        rows.append(data[3:5])
    assert rows.buf is buf and len(rows) == 3  # nothing half-written counted


def test_fixed_rows_need_a_2d_buffer() -> None:
    with pytest.raises(ValueError, match="FixedRows needs a \\[capacity, dim\\] buffer"):
        FixedRows(torch.zeros(4))


if __name__ == "__main__":
    run_this_file(__file__)
