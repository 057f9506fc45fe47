"""What every tool-call parser shares: the request's tools and choice, which parsed calls are
valid, and the OpenAI shapes of calls and of their streamed deltas.

A call is returned in ``tool_calls`` only when the client can run it: its name is one of the
request's tools (and the one ``tool_choice`` names, if it names one), tools are allowed
(``tool_choice`` is not ``none``), and it is the first call when ``parallel_tool_calls`` is false.
Any other call the model writes is kept out of ``tool_calls`` and out of ``content`` and reported
in ``invalid_tool_calls`` (name, raw arguments, the reason), so a client can tell the model what
went wrong. ``arguments`` is always a JSON object string: a value the model wrote as JSON but that
does not parse is passed as a JSON string of its text.

Streaming: a call's header (index, id, name) is sent as soon as its name is complete and valid,
its arguments in one piece when the call closes.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.chat.encoding import ToolChoice


@dataclass
class ToolParseResult:
    content: str = ""
    deltas: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool_call deltas

    def extend(self, other: ToolParseResult) -> None:
        self.content += other.content
        self.deltas += other.deltas


def json_value(text: str) -> Any:
    """A value the model wrote as JSON; its text as a string when it does not parse."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def dump_arguments(arguments: Mapping[str, Any]) -> str:
    return json.dumps(dict(arguments), ensure_ascii=False)


class ToolCallParser(ABC):
    """One output's tool calls, fed the content text (after any reasoning) chunk by chunk."""

    # Strings of the format's markup: kept in the decoded text (even if special tokens) so the
    # parser can see them.
    markers: tuple[str, ...] = ()

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] = (),
        choice: ToolChoice | None = None,
        parallel: bool = True,
        id_offset: int = 0,
    ) -> None:
        self.tool_names = tuple(str(t["function"]["name"]) for t in tools)
        self.choice = choice or ToolChoice("auto" if tools else "none")
        self.parallel = parallel
        self.id_offset = id_offset
        self.calls: list[dict[str, Any]] = []  # valid calls, OpenAI message shape
        self.invalid: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the call being parsed, if its header was sent
        self._buf = ""  # text held until the format can tell what it is
        self._name: str | None = None  # the open call's name, once its header is complete ("")

    # --- the format ----------------------------------------------------------------------------

    @abstractmethod
    def feed(self, text: str) -> ToolParseResult: ...

    @abstractmethod
    def finish(self) -> ToolParseResult:
        """The end of the output: held text, and a call cut short (closed with what is known)."""

    def call_id(self, name: str, index: int) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    # --- shared bookkeeping --------------------------------------------------------------------

    def why_invalid(self, name: str) -> str | None:
        if self.choice.mode == "none":
            return "tools are off for this request (tool_choice is none or no tools were given)"
        if name not in self.tool_names:
            return f"unknown tool {name!r}; the request's tools are {list(self.tool_names)}"
        if self.choice.mode == "function" and name != self.choice.name:
            return f"tool_choice names the function {self.choice.name!r}"
        if self.calls and not self.parallel:
            return "parallel_tool_calls is false and a call was already made"
        return None

    def begin_call(self, name: str) -> list[dict[str, Any]]:
        """A call whose name is known: its header delta if it is valid."""
        if self.why_invalid(name) is not None:
            self._open = None
            return []
        index = len(self.calls)
        call = {
            "id": self.call_id(name, self.id_offset + index),
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        self._open = call
        self.calls.append(call)
        delta = {"index": index, **call, "function": dict(call["function"])}
        return [delta]

    def close_call_at(
        self, out: ToolParseResult, close: str, parse: Callable[[str], Mapping[str, Any]]
    ) -> bool:
        """The open call's body, once ``close`` ends it in the held text: its arguments
        (``parse`` reads the format's parameters) end the call (an ``invalid_tool_calls`` entry
        when its header named no tool); False while the body is still incomplete."""
        end = self._buf.find(close)
        if end < 0:
            return False
        args = dump_arguments(parse(self._buf[:end]))
        self._buf = self._buf[end + len(close) :]
        name, self._name = self._name, None
        if name:
            out.deltas += self.end_call(name, args)
        else:
            self.invalid.append({"name": "", "arguments": args, "error": "no tool name"})
        return True

    def end_call(self, name: str, arguments: str) -> list[dict[str, Any]]:
        """The call closed with ``arguments`` (a JSON object string): its arguments delta, or an
        ``invalid_tool_calls`` entry when its header was not sent."""
        call, self._open = self._open, None
        if call is None or call["function"]["name"] != name:
            self.invalid.append(
                {
                    "name": name,
                    "arguments": arguments,
                    "error": self.why_invalid(name) or "the call is malformed",
                }
            )
            return []
        call["function"]["arguments"] = arguments
        return [{"index": self.calls.index(call), "function": {"arguments": arguments}}]
