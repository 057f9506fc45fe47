"""How many cache slots the static decode preallocates, how long a request may be, and how many
tokens of paged state (blocks) they share.

A slot is a request's fixed-size state (window rings, compressor pending rows, its block-table
row), so there are ``--max-running-requests`` of them whatever the context. The state that grows
with the length (compressed entries, indexer keys) is paged: the slots share blocks worth
``--max-total-tokens`` (the memory budget), and a request holds only the blocks of its live
length. A request is at most ``min(context length, --max-total-tokens)`` tokens (its table's
width). The scheduler admits by blocks (:class:`SchedulePolicy` with ``block_tokens``), so a slot
never waits for a whole context's memory.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotPlan:
    slots: int
    capacity: int  # the longest request, in tokens
    total_tokens: int  # paged tokens all slots share (the pool rounds down to whole blocks)


def plan_slot_pool(
    *, context_length: int, max_total_tokens: int, max_running_requests: int
) -> SlotPlan:
    if min(context_length, max_total_tokens, max_running_requests) < 1:
        raise ValueError(
            f"slot pool limits must be >= 1: context {context_length}, total tokens "
            f"{max_total_tokens}, running requests {max_running_requests}"
        )
    capacity = min(context_length, max_total_tokens)
    return SlotPlan(slots=max_running_requests, capacity=capacity, total_tokens=max_total_tokens)
