"""Incremental detokenization and stop strings for one request.

Tokens are decoded in a sliding window (``prefix_offset .. read_offset`` already shown, plus the
new ones) rather than all at once, so a step costs O(window) and text split across tokens (UTF-8
sequences, byte-level merges) is emitted only once it is complete (no trailing U+FFFD).

Stop strings are searched in the text produced so far; the text is cut before the match. While
streaming, the tail that could still grow into a stop string is held back.
"""

from __future__ import annotations

from collections.abc import Sequence

from sglang.srt.managers.tokenizer import TextTokenizer


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        skip_ids: frozenset[int] | None = None,
    ) -> None:
        """``skip_ids``: drop exactly these ids from the text (instead of every special token),
        so markup made of special tokens that a parser reads stays in it."""
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.skip_ids = skip_ids
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.matched_stop: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        if self.skip_ids is not None:
            kept = [i for i in ids if i not in self.skip_ids]
            return self.tok.decode(kept, skip_special_tokens=False)
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, new_ids: Sequence[int], *, final: bool = False) -> None:
        """Append tokens; with ``final`` flush any incomplete tail. Stops at a stop string."""
        if self.matched_stop is not None:
            return
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            start = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._find_stop(start)

    def _find_stop(self, new_from: int) -> None:
        if not self.stop:
            return
        longest = max(len(s) for s in self.stop)
        window_start = max(0, new_from - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = self.text.find(s, window_start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.matched_stop = best[1]

    def visible_text(self, finished: bool) -> str:
        """The text safe to show now: all of it when finished, else without a tail that is the
        start of a stop string."""
        if finished or not self.stop:
            return self.text
        hold = 0
        for k in range(min(max(len(s) for s in self.stop) - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                hold = k
                break
        return self.text[: len(self.text) - hold]


class TokenOffsets:
    """Where each token's text starts in the decoded text (OpenAI's ``text_offset``): the
    length of everything decoded before the token, plus ``start``. Special tokens that the decode
    skips take no room; bytes not yet a whole character count as the one replacement character
    they decode to (a character split over tokens is one character either way, and an invalid
    byte stays U+FFFD in the text)."""

    def __init__(self, tokenizer: TextTokenizer, *, skip_special_tokens: bool, start: int = 0):
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.start = start

    def _length(self) -> int:
        d = self._detok
        if d.read_offset == len(d.ids):
            return len(d.text)
        shown = d._decode(d.ids[d.prefix_offset : d.read_offset])
        pending = d._decode(d.ids[d.prefix_offset :])
        return len(d.text) + max(0, len(pending) - len(shown))

    def add(self, ids: Sequence[int]) -> list[int]:
        out = []
        for token in ids:
            out.append(self.start + self._length())
            self._detok.add([token])
        return out
