"""Registered NCCL windows of one communicator, as sorted address ranges.

NCCL takes the symmetric path only when the whole buffer lies inside one registered window; this
mirror of its window table answers "would it?" with one bisect, cheap enough for every
all-reduce.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    base: int
    size: int
    handle: int

    @property
    def end(self) -> int:
        return self.base + self.size


class WindowRanges:
    """Non-overlapping ``[base, base + size)`` ranges kept sorted by base."""

    def __init__(self) -> None:
        self._bases: list[int] = []
        self._windows: list[Window] = []

    def __len__(self) -> int:
        return len(self._windows)

    def add(self, base: int, size: int, handle: int = 0) -> Window:
        if size <= 0:
            raise ValueError(f"window size must be positive, got {size}")
        i = bisect.bisect_right(self._bases, base)
        if i > 0 and self._windows[i - 1].end > base:
            raise ValueError(f"window at {base:#x} overlaps {self._windows[i - 1]}")
        if i < len(self._windows) and base + size > self._windows[i].base:
            raise ValueError(f"window at {base:#x} overlaps {self._windows[i]}")
        window = Window(base, size, handle)
        self._bases.insert(i, base)
        self._windows.insert(i, window)
        return window

    def find(self, ptr: int, nbytes: int) -> Window | None:
        """The window holding all of ``[ptr, ptr + nbytes)``, or None."""
        if nbytes <= 0:
            return None
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i < 0:
            return None
        window = self._windows[i]
        return window if ptr + nbytes <= window.end else None

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self.find(ptr, nbytes) is not None

    def windows(self) -> list[Window]:
        """In address order."""
        return list(self._windows)

    def clear(self) -> list[Window]:
        out = self._windows
        self._bases, self._windows = [], []
        return out
