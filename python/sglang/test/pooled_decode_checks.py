"""Checks of a model's static (pooled-slot) decode that every model with a slot pool must pass
the same way: its refusals, and its logits against the eager decode on per-request caches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from sglang.test.tolerance import rel_max_err


def check_decode_pooled_refusals(model: Any, capacity: int) -> None:
    """``decode_pooled`` refuses a cache outside the slot pool, and a pooled cache already
    holding ``capacity`` tokens (the pool's length), each with an error that says which."""
    with pytest.raises(ValueError, match="pooled"):
        model.decode_pooled(torch.tensor([1]), [model.new_request_cache()])
    cache = model.new_pooled_cache()
    cache.num_tokens = capacity
    with pytest.raises(RuntimeError, match="capacity"):
        model.decode_pooled(torch.tensor([1]), [cache])
    model.free_pooled_cache(cache)


def prefill_eager_and_pooled(
    model: Any, seqs: Sequence[torch.Tensor], lengths: Sequence[int]
) -> tuple[list[Any], list[Any]]:
    """-> (per-request caches, pooled caches), each request's prompt ``seqs[i][:lengths[i]]``
    prefilled into both."""
    eager = [model.new_request_cache() for _ in lengths]
    pooled = [model.new_pooled_cache() for _ in lengths]
    for seq, n, e, p in zip(seqs, lengths, eager, pooled):
        model.prefill(seq[:n], e)
        model.prefill(seq[:n], p)
    return eager, pooled


def worst_pooled_vs_eager(
    model: Any,
    seqs: Sequence[torch.Tensor],
    lengths: Sequence[int],
    steps: int,
    eager: Sequence[Any],
    pooled: Sequence[Any],
    *,
    pad_to: int,
) -> float:
    """``steps`` teacher-forced decode steps (request i's next id ``seqs[i][lengths[i] + t]``) on
    the per-request caches and, padded to ``pad_to`` rows, on the pooled ones: the largest
    :func:`rel_max_err` (in fp32) of the pooled logits against the eager ones."""
    worst = 0.0
    for t in range(steps):
        ids = torch.stack([seq[n + t] for seq, n in zip(seqs, lengths)])
        want = model.decode(ids, eager)
        got = model.decode_pooled(ids, pooled, pad_to=pad_to)
        assert got.shape == want.shape, (got.shape, want.shape)
        worst = max(worst, rel_max_err(got.float(), want.float()))
    return worst
