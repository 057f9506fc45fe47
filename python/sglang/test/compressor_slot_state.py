"""A DeepSeek V4 compressor slot store's state as the tests handle it: its tensors, a deep copy,
and two paths that update it in place run from the same state (they must leave the same)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from sglang.srt.mem_cache.deepseek_v4_slot_pool import CompressorSlots


def slot_tensors(store: CompressorSlots | None) -> list[torch.Tensor]:
    """The store's entries, pending rows and (overlapping windows only) previous-block rows;
    none for a layer without the compressor."""
    if store is None:
        return []
    parts = (store.entries, store.pending_kv, store.pending_score, store.prev_kv, store.prev_score)
    return [t for t in parts if t is not None]


def clone_slots(store: CompressorSlots) -> CompressorSlots:
    """The same store with every tensor copied: the expected side of an in-place update."""
    return dataclasses.replace(
        store,
        entries=store.entries.clone(),
        pending_kv=store.pending_kv.clone(),
        pending_score=store.pending_score.clone(),
        prev_kv=None if store.prev_kv is None else store.prev_kv.clone(),
        prev_score=None if store.prev_score is None else store.prev_score.clone(),
    )


def run_from_same_state(
    state: list[torch.Tensor],
    first: Callable[[], torch.Tensor],
    second: Callable[[], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``first()`` then, from the state it started with, ``second()``; both update ``state`` in
    place and must leave it bit-identical. Returns both outputs."""
    before = [t.clone() for t in state]
    got = first()
    after = [t.clone() for t in state]
    for t, b in zip(state, before):
        t.copy_(b)
    want = second()
    assert all(torch.equal(t, a) for t, a in zip(state, after)), "different state updates"
    return got, want
