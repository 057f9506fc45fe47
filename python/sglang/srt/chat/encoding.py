"""What every chat encoding takes and gives: a normalized conversation in, prompt segments out.

A prompt is a list of segments rather than one string because formats differ in how their text
is tokenized: Kimi K3 encodes its structural markers as control tokens and everything the client
wrote as ordinary text (a literal ``<|open|>`` in a user message stays text), so each segment is
tokenized on its own; DeepSeek V4's published encoder builds one string and tokenizes it whole.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class ChatEncodingError(ValueError):
    """The conversation cannot be encoded (the client's error); the message says why."""


@dataclass(frozen=True)
class PromptSegment:
    text: str
    # Whether the tokenizer may turn special-token spellings in ``text`` into control tokens.
    special: bool


@dataclass(frozen=True)
class ChatPrompt:
    segments: tuple[PromptSegment, ...]
    # Whether the generation prompt opened the reasoning (the output starts inside it).
    thinking: bool

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)


@dataclass(frozen=True)
class ToolChoice:
    """``auto`` (the model decides), ``none``, ``required`` (at least one call) or ``function``
    (exactly one call of ``name``)."""

    mode: str = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ChatOptions:
    """Everything besides the messages that shapes the prompt."""

    tools: tuple[Mapping[str, Any], ...] = ()  # OpenAI format: {"type": "function", "function"}
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    response_format: Mapping[str, Any] | None = None  # json_object / json_schema only
    thinking: bool | None = None  # None: the encoding's default
    reasoning_effort: str | None = None  # OpenAI's values plus "max"
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # A conversation ending with an assistant turn: continue that turn (no end marker, no
    # generation prompt) instead of closing it.
    continue_final_message: bool = False


class ChatEncoding(ABC):
    """One model's chat format."""

    name: str = ""
    default_thinking: bool = False
    # The parsers that read this format's output back (names in parsers/registry.py).
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    # Strings the tokenizer must hold as single tokens for the prompt to tokenize as trained.
    marker_tokens: tuple[str, ...] = ()

    def thinking_enabled(self, options: ChatOptions) -> bool:
        kwargs = options.template_kwargs
        for key in ("thinking", "enable_thinking"):
            if key in kwargs and kwargs[key] is not None:
                return bool(kwargs[key])
        if options.reasoning_effort == "none":
            return False
        return self.default_thinking if options.thinking is None else options.thinking

    @abstractmethod
    def render(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions) -> ChatPrompt:
        """The prompt for ``messages`` (normalized, see :mod:`messages`) with the generation
        prompt appended. Raises :class:`ChatEncodingError`."""

    def content_affixes(self, thinking: bool) -> tuple[str, str]:
        """The text the output must carry before and after a constrained answer (a JSON
        ``response_format``): the format's content channel markup, if any. Empty by default."""
        return "", ""
