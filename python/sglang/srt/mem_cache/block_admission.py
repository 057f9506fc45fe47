"""Admission by free blocks: how many requests of a given live length a block pool can run, and
whether the next one fits, against the unpaged slot pool's whole-context reservation (what the
server did before its pool was paged; ``scripts/paged_capacity.py`` prints both).

With slots, every running request reserved ``capacity`` tokens (the context length), so
``slots = total_tokens // capacity`` however short the requests are. With blocks, a request
reserves ``ceil((prompt + max new tokens) / block) * block`` tokens, so the same memory runs
``total_tokens // that`` requests (both capped by ``--max-running-requests``).
"""

from __future__ import annotations

from sglang.srt.mem_cache.block_pool import BlockPool, blocks_for


def slot_concurrency(total_tokens: int, context_length: int, max_running: int) -> int:
    """Requests an unpaged slot pool (one whole context a slot) runs at once."""
    capacity = min(context_length, total_tokens)
    return min(max_running, max(1, total_tokens // capacity))


def block_concurrency(
    total_tokens: int, request_tokens: int, block_tokens: int, max_running: int
) -> int:
    """Requests of ``request_tokens`` (prompt + max new) a block pool of ``total_tokens`` runs."""
    per_request = blocks_for(request_tokens, block_tokens) * block_tokens
    return min(max_running, total_tokens // max(per_request, 1))


def admit(pool: BlockPool, reserved_tokens: int) -> bool:
    """Whether a request reserving ``reserved_tokens`` fits in the free blocks now (a request that
    does not fit waits for running ones to finish; it is never a failure)."""
    return pool.can_allocate(pool.blocks_for(reserved_tokens))
