"""The default --max-total-tokens on a GPU: cached-token cost of DeepSeek V4's compressed layers,
the fixed window and workspace costs, the cap, and an actionable error when nothing fits."""

from __future__ import annotations

import pytest

from sglang.srt.model_executor.memory_budget import (
    CacheShape,
    MemoryBudgetError,
    max_total_tokens_for_memory,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=1)

SHAPE = CacheShape(
    num_layers=3,
    hidden_size=64,
    hc_mult=2,
    vocab_size=100,
    head_dim=32,
    index_head_dim=16,
    sliding_window=8,
    compress_ratios=(0, 4, 128),
    attn_types=("sliding", "csa", "hca"),
    dtype_bytes=2,
)


def test_costs() -> None:
    assert SHAPE.bytes_per_cached_token() == pytest.approx(32 * 2 / 4 + 16 * 2 / 4 + 32 * 2 / 128)
    assert SHAPE.window_bytes_per_request() == 3 * 8 * 32 * 2
    assert SHAPE.workspace_bytes(10) == 10 * (100 * 8 + 64 * 2 * 4 * 32)


def test_budget_and_cap() -> None:
    fixed = SHAPE.workspace_bytes(16 + 4) + 4 * SHAPE.window_bytes_per_request()
    room = fixed + 24_500
    got = max_total_tokens_for_memory(
        SHAPE,
        room_bytes=room,
        max_running_requests=4,
        chunked_prefill_size=16,
        context_length=10**6,
    )
    assert got == int(24_500 // SHAPE.bytes_per_cached_token())
    capped = max_total_tokens_for_memory(
        SHAPE, room_bytes=room, max_running_requests=4, chunked_prefill_size=16, context_length=100
    )
    assert capped == 400


def test_not_enough_memory_says_what_to_change() -> None:
    with pytest.raises(MemoryBudgetError, match="--max-running-requests"):
        max_total_tokens_for_memory(
            SHAPE,
            room_bytes=1000,
            max_running_requests=4,
            chunked_prefill_size=16,
            context_length=64,
        )


if __name__ == "__main__":
    run_this_file(__file__)
