"""How many cache slots, of how many tokens each, the static decode preallocates.

A slot holds one whole request, so its capacity is the longest request the server admits:
``min(context length, --max-total-tokens)``. The slots together may not hold more tokens than
``--max-total-tokens`` (the memory budget), so with long contexts there can be fewer slots than
``--max-running-requests``; the scheduler then runs at most that many requests at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotPlan:
    slots: int
    capacity: int


def plan_slot_pool(
    *, context_length: int, max_total_tokens: int, max_running_requests: int
) -> SlotPlan:
    if min(context_length, max_total_tokens, max_running_requests) < 1:
        raise ValueError(
            f"slot pool limits must be >= 1: context {context_length}, total tokens "
            f"{max_total_tokens}, running requests {max_running_requests}"
        )
    capacity = min(context_length, max_total_tokens)
    slots = min(max_running_requests, max(1, max_total_tokens // capacity))
    return SlotPlan(slots=slots, capacity=capacity)
