"""Where a request's reasoning ends, and the thinking budget.

The reasoning ends when the output holds the format's end-of-thinking token sequence (DeepSeek
V4's ``</think>``, Kimi K3's ``<|close|>think<|sep|>``). With a budget, once that many reasoning
tokens are out the end sequence is forced, token by token, and the answer follows. A request's
grammar waits for the end of the reasoning.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningControl:
    """Sent with a request whose output starts inside its reasoning."""

    end_ids: tuple[int, ...]
    budget: int | None = None  # reasoning tokens before the end sequence is forced


class ReasoningTracker:
    def __init__(self, control: ReasoningControl) -> None:
        self.control = control
        self.in_reasoning = bool(control.end_ids)
        self.tokens = 0
        self._recent: deque[int] = deque(maxlen=max(1, len(control.end_ids)))
        self._forcing: list[int] = []

    def forced_token(self) -> int | None:
        """The token the next step must produce (the budget is spent), or None."""
        if not self.in_reasoning:
            return None
        budget = self.control.budget
        if not self._forcing and budget is not None and self.tokens >= budget:
            # Continue a partly written end sequence rather than starting it over.
            ids = self.control.end_ids
            done = max(
                (k for k in range(len(ids), 0, -1) if list(self._recent)[-k:] == list(ids[:k])),
                default=0,
            )
            self._forcing = list(ids[done:])
        return self._forcing[0] if self._forcing else None

    def observe(self, token: int) -> bool:
        """Count an output token; True when it ended the reasoning."""
        if not self.in_reasoning:
            return False
        self.tokens += 1
        self._recent.append(token)
        if self._forcing and self._forcing[0] == token:
            self._forcing.pop(0)
        if tuple(self._recent) == self.control.end_ids:
            self.in_reasoning = False
            self._forcing = []
            return True
        return False
