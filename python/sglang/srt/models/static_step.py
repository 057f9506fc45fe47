"""Host side of a static decode step over pooled request caches (both models share it): the
device tensors a step takes, the padding of a batch to a captured size, and the step itself.

Positions come from the host counts (no device read): each cache's ``num_tokens`` is the position
of its next token. Padding rows decode token 0 at position 0 in the pool's scratch slot, so they
never write a real request's cache and cannot produce NaN in the real rows (rows are independent).
Kimi K3's static decode shares these (its caches and pool have the same ``slot`` / ``capacity``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from sglang.srt.mem_cache.slot_blocks import SlotPoolSize

# (input_ids, positions, slots) of B real rows -> logits [B, V]: the static decode padded to some
# size, or a CUDA-graph replay.
StaticStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class PooledCache(Protocol):
    """A request cache in a slot of a pool (DeepSeek V4's or Kimi K3's)."""

    slot: int | None
    num_tokens: int

    def count_static_token(self) -> None:
        """Count the token a static step wrote on the device into the host counters."""


class SizedPool(Protocol):
    capacity: int  # the longest request a slot holds, in tokens


def static_decode_inputs(
    pool: SizedPool, caches: Sequence[PooledCache], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, slots)`` int64 ``[B]`` on ``device`` for one new token of each cache."""
    positions, slots = [], []
    for cache in caches:
        if cache.slot is None:
            raise ValueError("the static decode needs pooled caches (model.new_pooled_cache())")
        if cache.num_tokens >= pool.capacity:
            raise RuntimeError(
                f"a request at {cache.num_tokens} tokens exceeds the slot capacity {pool.capacity}"
            )
        positions.append(cache.num_tokens)
        slots.append(cache.slot)
    both = torch.tensor([positions, slots], dtype=torch.long)
    both = both.to(device, non_blocking=True) if device.type != "cpu" else both
    return both[0], both[1]


def pad_rows(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    size: int,
    scratch_slot: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three ``[B]`` tensors padded to ``[size]`` (token 0, position 0, scratch slot)."""
    extra = size - input_ids.shape[0]
    if extra < 0:
        raise ValueError(f"cannot pad {input_ids.shape[0]} rows down to {size}")
    if extra == 0:
        return input_ids, positions, slots
    zeros = input_ids.new_zeros(extra)
    return (
        torch.cat([input_ids, zeros]),
        torch.cat([positions, positions.new_zeros(extra)]),
        torch.cat([slots, slots.new_full((extra,), scratch_slot)]),
    )


class StepPool(SizedPool, Protocol):
    scratch_slot: int

    def reserve(self, slot: int, tokens: int) -> None: ...


def run_pooled_step(
    pool: StepPool,
    static_decode: StaticStep,
    input_ids: torch.Tensor,
    caches: Sequence[PooledCache],
    *,
    pad_to: int | None,
    step: StaticStep | None,
) -> torch.Tensor:
    """One token for each pooled cache: reserves the new token's block (a new one when it crosses
    an edge), then runs ``step`` (a graph replay, on the real rows) or else ``static_decode``
    padded to ``pad_to`` rows with the scratch slot, and counts the token into each cache's host
    counters (``count_static_token``) -> logits ``[B, V]``."""
    positions, slots = static_decode_inputs(pool, caches, input_ids.device)
    for cache in caches:
        assert cache.slot is not None
        pool.reserve(cache.slot, cache.num_tokens + 1)
    if step is not None:
        logits = step(input_ids, positions, slots)
    else:
        padded = pad_rows(input_ids, positions, slots, pad_to or len(caches), pool.scratch_slot)
        logits = static_decode(*padded)[: len(caches)]
    for cache in caches:
        cache.count_static_token()
    return logits


class SlotPoolDecode:
    """The pooled-cache half of a model's static decode, the same for both models: preallocate
    the pool, take a cache in a free slot and give it back, and decode one token per pooled
    cache. The model builds its pool (``new_slot_pool``) and defines ``static_decode``."""

    slot_pool: Any
    static_decode: StaticStep

    def new_slot_pool(self, size: SlotPoolSize) -> Any:
        """The model's slot pool of ``size`` (its layers' fixed state by slot, its growing state
        in the blocks the slots share)."""
        raise NotImplementedError

    def enable_slot_pool(
        self,
        max_slots: int,
        capacity: int,
        *,
        num_blocks: int | None = None,
        block_tokens: int | None = None,
        total_tokens: int | None = None,
    ) -> Any:
        """Preallocate the static cache (:class:`SlotPoolSize` says how large); the static
        decode and CUDA graphs need it. Replaces any earlier pool."""
        size = SlotPoolSize(max_slots, capacity, num_blocks, block_tokens, total_tokens)
        self.slot_pool = self.new_slot_pool(size)
        return self.slot_pool

    def new_pooled_cache(self) -> Any:
        """A request cache in a free slot of the pool (eager forwards and the static decode both
        use it); give it back with :meth:`free_pooled_cache`."""
        pool = self._slot_pool()
        return pool.request_cache(pool.alloc())

    def _slot_pool(self) -> Any:
        if self.slot_pool is None:
            raise RuntimeError("no slot pool: call enable_slot_pool() first")
        return self.slot_pool

    def reserve_blocks(self, caches: Sequence[PooledCache], seq_lens: Sequence[int]) -> None:
        """Give each pooled cache the blocks its next ``seq_lens`` rows fill, before a forward
        writes them (caches that own their tensors need none)."""
        for cache, n in zip(caches, seq_lens):
            if cache.slot is not None:
                self._slot_pool().reserve(cache.slot, cache.num_tokens + n)

    def free_pooled_cache(self, cache: PooledCache) -> None:
        """Return the cache's slot and its blocks."""
        if cache.slot is not None:
            self._slot_pool().free(cache.slot)
            cache.slot = None

    def decode_pooled(
        self,
        input_ids: torch.Tensor,
        caches: Sequence[PooledCache],
        *,
        pad_to: int | None = None,
        step: StaticStep | None = None,
    ) -> torch.Tensor:
        """``decode`` through the static path for pooled caches: pads to ``pad_to`` rows with
        the scratch slot, runs ``step`` (default ``static_decode``; a CUDA-graph replay has the
        same signature) and counts the token into every cache; logits ``[B, V]``."""
        return run_pooled_step(
            self._slot_pool(), self.static_decode, input_ids, caches, pad_to=pad_to, step=step
        )
