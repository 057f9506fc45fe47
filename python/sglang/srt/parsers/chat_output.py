"""One choice's output, read back as it streams: reasoning, content and tool calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang.srt.parsers.reasoning import ReasoningParser
from sglang.srt.parsers.tool_call import ToolCallParser, ToolParseResult


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """Feed the output text as it grows (only the new part each time); every piece of text is
    shown once, as reasoning or content, never as markup, however the chunks split it."""

    def __init__(
        self, reasoning: ReasoningParser | None = None, tools: ToolCallParser | None = None
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.reasoning_text = ""
        self.content_text = ""

    @property
    def markers(self) -> tuple[str, ...]:
        found: tuple[str, ...] = () if self.reasoning is None else self.reasoning.fmt.markers
        return found + (() if self.tools is None else self.tools.markers)

    def _content(self, text: str, final: bool) -> ToolParseResult:
        if self.tools is None:
            return ToolParseResult(content=text)
        out = self.tools.feed(text) if text else ToolParseResult()
        if final:
            out.extend(self.tools.finish())
        return out

    def _step(self, text: str, final: bool) -> ChatDelta:
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if final and self.reasoning is not None:
            held, _ = self.reasoning.finish()
            reasoning += held
        parsed = self._content(content, final)
        self.reasoning_text += reasoning
        self.content_text += parsed.content
        return ChatDelta(reasoning, parsed.content, parsed.deltas)

    def feed(self, text: str) -> ChatDelta:
        return self._step(text, final=False)

    def finish(self, text: str = "") -> ChatDelta:
        """The last text (if any) and everything held back."""
        return self._step(text, final=True)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [] if self.tools is None else self.tools.calls

    @property
    def invalid_tool_calls(self) -> list[dict[str, Any]]:
        return [] if self.tools is None else self.tools.invalid
