"""Separating reasoning from content, streamed: everything up to the format's end-of-thinking
marker is reasoning, the rest is content. A format may also end the reasoning implicitly (the
model starts a tool call or its answer channel without closing the reasoning); that text stays in
the content for the tool-call parser."""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.parsers.marker_buffer import find_first, held_suffix


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str  # opens the reasoning (usually already in the generation prompt)
    end: str  # closes it; what the thinking budget forces when it is spent
    implicit_ends: tuple[str, ...] = ()

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.start, self.end, *self.implicit_ends)


class ReasoningParser:
    """One output's reasoning split. ``in_reasoning``: the generation prompt opened the
    reasoning (thinking on), so the output starts inside it."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool = True) -> None:
        self.fmt = fmt
        self.in_reasoning = in_reasoning
        self._buf = ""
        self._at_start = True

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) shown for ``text``."""
        if not self.in_reasoning:
            return "", text
        self._buf += text
        if self._at_start:  # a model that repeats the opening marker: drop it
            head = self._buf.lstrip()
            if self.fmt.start.startswith(head) and len(head) < len(self.fmt.start):
                return "", ""  # may still become the opening marker
            if head.startswith(self.fmt.start):
                self._buf = head[len(self.fmt.start) :]
            self._at_start = False
        pos, marker = find_first(self._buf, (self.fmt.end, *self.fmt.implicit_ends))
        if marker is not None:
            reasoning = self._buf[:pos]
            rest = self._buf[pos + len(marker) :] if marker == self.fmt.end else self._buf[pos:]
            self._buf, self.in_reasoning = "", False
            return reasoning, rest
        hold = held_suffix(self._buf, (self.fmt.end, *self.fmt.implicit_ends))
        reasoning, self._buf = (
            self._buf[: len(self._buf) - hold],
            self._buf[len(self._buf) - hold :],
        )
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """Whatever is held back, at the end of the output (reasoning that never closed)."""
        held, self._buf = self._buf, ""
        return (held, "") if self.in_reasoning else ("", "")
