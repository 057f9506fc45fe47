"""What the memory budget needs of an architecture (``model_executor/memory_budget.py``)."""

from __future__ import annotations

from typing import Protocol


class MemoryModel(Protocol):
    """The bytes one rank holds for the caches and one step's workspace, in three parts: what
    grows with every cached token, what the running requests hold whatever their length, and
    what a step needs for its tokens in flight and its logit rows."""

    def bytes_per_cached_token(self) -> float:
        """The paged state one more cached token takes (every layer's share)."""
        ...

    def fixed_bytes(self, running_requests: int, context_length: int) -> int:
        """What ``running_requests`` requests of up to ``context_length`` tokens hold besides
        their cached tokens (window rings, recurrent states, the pool's scratch slot)."""
        ...

    def snapshot_bytes(self) -> int:
        """One state snapshot of the prefix cache: a request's fixed-size state at a block edge
        (``SlotBlocks.edge_state``)."""
        ...

    def activation_bytes(self, tokens_in_flight: int) -> int:
        """A step's temporaries for ``tokens_in_flight`` rows (a prefill chunk plus decodes)."""
        ...

    def logits_bytes(self, logit_rows: int) -> int:
        """The fp32 logits of ``logit_rows`` rows and the sampler's copy."""
        ...

    def workspace_bytes(self, tokens_in_flight: int, logit_rows: int) -> int:
        """:meth:`activation_bytes` plus :meth:`logits_bytes`."""
        ...

    def describe(self) -> str:
        """One line for the startup log: the architecture and its per-token / per-request costs."""
        ...
