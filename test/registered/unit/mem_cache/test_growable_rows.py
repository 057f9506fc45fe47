"""Append-only row buffers: GrowableRows grows and keeps what it held."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.growable_rows import GrowableRows
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=0.5)


def test_growable_rows_grow_and_keep_contents() -> None:
    rows = GrowableRows(3, dtype=torch.float32, capacity=2)
    data = torch.randn(11, 3)
    rows.append(data[:1])
    rows.append(data[1:1])  # empty append is a no-op
    rows.append(data[1:11])
    assert len(rows) == 11 and rows.buf.shape[0] >= 11
    assert torch.equal(rows.rows(), data)


if __name__ == "__main__":
    run_this_file(__file__)
