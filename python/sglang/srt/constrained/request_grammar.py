"""One request's grammar while it decodes: the matcher that says which tokens may come next.

Where the grammar allows one text only (markup around a tool call, a JSON key), the scheduler
takes the first token of that text's own tokenization instead of sampling among every spelling the
mask allows: the model reads markup tokenized as it was trained, and a literal takes as few steps
as its tokens.

With thinking on, the grammar applies only to the answer: it stays inactive until the reasoning
ends (the scheduler activates it then), so the reasoning itself is free text.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

_batch_filler: Any = None
_THREADED_FROM = 4  # rows


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

    def forced_text(self) -> str:
        """The text the grammar allows next and nothing else (a literal such as a tool-call
        tag), empty when the next step has a choice."""
        return str(self.matcher.find_jump_forward_string())

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def fill_bitmasks(grammars: Sequence[RequestGrammar], bitmask: Any, rows: Sequence[int]) -> None:
    """Fill ``bitmask[rows[i]]`` from ``grammars[i]``: many rows at once on a few threads
    (xgrammar's batch matcher), a few directly (threads cost more than they save there)."""
    global _batch_filler
    if len(grammars) < _THREADED_FROM:
        for grammar, row in zip(grammars, rows):
            grammar.fill_bitmask(bitmask, row)
        return
    if _batch_filler is None:
        import xgrammar as xgr

        _batch_filler = xgr.BatchGrammarMatcher(max_threads=max(1, min(8, os.cpu_count() or 1)))
    _batch_filler.batch_fill_next_token_bitmask(
        [g.matcher for g in grammars], bitmask, indices=list(rows)
    )
