"""Holding back text that may be the start of a marker, so markup split across stream chunks at
any point never reaches the client as content."""

from __future__ import annotations

from collections.abc import Sequence


def held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``
    (0: all of ``text`` is safe to show)."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


def find_first(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str | None]:
    """The earliest occurrence of any marker at or after ``start``: (position, marker), or
    (-1, None)."""
    best, found = -1, None
    for marker in markers:
        pos = text.find(marker, start)
        if pos >= 0 and (best < 0 or pos < best):
            best, found = pos, marker
    return best, found
