"""The slot bookkeeping both models' slot pools share: ``max_slots`` request slots plus one scratch
slot (``rows = max_slots + 1``; padding rows of a padded batch use the scratch slot), a block pool
sized for them with each slot's block table in device memory, and the free list (lowest slot
first: reuse keeps the touched memory small and the tests predictable). A pool subclasses it,
allocates its per-slot tensors with ``rows`` rows, says in :meth:`_reset` what a slot taken anew
must hold and in :meth:`edge_state` which of them a request's state at a block edge is (what the
prefix cache snapshots; ``state_snapshots.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.block_pool import BlockPool
from sglang.srt.mem_cache.paged_block_table import PagedBlockTable

# Tokens a cache block holds unless a pool is told otherwise (DeepSeek V4 rounds it up to a
# multiple of its compress ratios). One block of every paged layer per table entry: larger blocks
# mean shorter tables, smaller ones less rounding per request.
DEFAULT_BLOCK_TOKENS = 256


class SlotPoolFullError(RuntimeError):
    """Every slot is taken; the scheduler admits at most ``max_slots`` running requests."""


@dataclass(frozen=True)
class SlotPoolSize:
    """How large a slot pool is: ``max_slots`` requests of up to ``capacity`` tokens each, their
    growing state in blocks of ``block_tokens`` tokens shared by all (default: the pool's own):
    ``num_blocks`` of them, or ``total_tokens`` worth rounded down to blocks (at least one whole
    request's); neither: every slot can hold a whole-capacity request."""

    max_slots: int
    capacity: int
    num_blocks: int | None = None
    block_tokens: int | None = None
    total_tokens: int | None = None


class SlotBlocks:
    def __init__(self, size: SlotPoolSize, *, device: torch.device) -> None:
        """A pool of ``size`` (``DEFAULT_BLOCK_TOKENS`` a block unless it says otherwise)."""
        max_slots, capacity = size.max_slots, size.capacity
        if max_slots < 1 or capacity < 1:
            raise ValueError(f"slot pool needs >= 1 slot and token, got {max_slots}, {capacity}")
        self.max_slots, self.capacity = max_slots, capacity
        self.scratch_slot = max_slots
        self.rows = max_slots + 1
        self.block_tokens = block_tokens = size.block_tokens or DEFAULT_BLOCK_TOKENS
        blocks_per_slot = -(-capacity // block_tokens)
        num_blocks = size.num_blocks
        if num_blocks is None:
            num_blocks = max_slots * blocks_per_slot  # the unpaged memory
            if size.total_tokens is not None:
                num_blocks = max(blocks_per_slot, size.total_tokens // block_tokens)
        self.block_pool = BlockPool(num_blocks, block_tokens)
        self.blocks = PagedBlockTable(
            self.block_pool, rows=self.rows, max_tokens=capacity, device=device
        )
        self._free = list(range(max_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def table_nbytes(self) -> int:
        return self.blocks.table.numel() * self.blocks.table.element_size()

    def alloc(self) -> int:
        """A free slot, reset by :meth:`_reset`."""
        if not self._free:
            raise SlotPoolFullError(f"all {self.max_slots} cache slots are in use")
        slot = self._free.pop()
        self._reset(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return the slot and every block it holds."""
        if not 0 <= slot < self.max_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not an allocated slot of this pool")
        self.blocks.release(slot)
        self._free.append(slot)

    def reserve(self, slot: int, tokens: int) -> None:
        """Give ``slot`` the blocks for ``tokens`` tokens before a forward writes them (raises
        :class:`~sglang.srt.mem_cache.block_pool.BlockPoolExhausted`, holding what it held, when
        the pool is short: the scheduler's admission by blocks keeps that from happening)."""
        self.blocks.ensure(slot, tokens)

    def edge_state(self) -> list[torch.Tensor]:
        """The per-slot tensors (first dimension: the ``rows`` slots) that, with the request's
        blocks, make its whole state when its length is a multiple of ``block_tokens``: a copy
        of their rows there lets another request resume at that edge."""
        raise NotImplementedError

    def _reset(self, slot: int) -> None:
        """What a slot taken anew must hold (nothing here)."""
