"""One request's grammar while it decodes: the matcher that says which tokens may come next.

With thinking on, the grammar applies only to the answer: it stays inactive until the reasoning
ends (the scheduler activates it then), so the reasoning itself is free text.
"""

from __future__ import annotations

from typing import Any


class RequestGrammar:
    def __init__(self, compiled: Any, active: bool = True) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.active = active

    @property
    def constrains(self) -> bool:
        """Whether the next token is masked (active and not finished)."""
        return self.active and not self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())
