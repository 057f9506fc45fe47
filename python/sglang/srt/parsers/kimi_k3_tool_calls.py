"""Kimi K3's answer channels (XTML), parsed from the streamed output: the ``response`` channel is
the content, the ``tools`` channel holds the calls; and the grammar that makes ``tool_choice``
``required`` or a named function hold::

    <|open|>response<|sep|>{content}<|close|>response<|sep|>
    <|open|>tools<|sep|>
    <|open|>call tool="get_weather" index="1"<|sep|>
    <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
    <|close|>call<|sep|>
    <|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>

The ``response`` opening is in the generation prompt when thinking is off and comes after the
reasoning when it is on. ``type="string"`` values are raw text, the others JSON. Call ids follow
Kimi K2's convention, ``functions.{name}:{index}``, counting the calls of the whole conversation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from sglang.srt.chat.encoding import ToolChoice
from sglang.srt.chat.kimi_k3 import CLOSE, END_OF_MSG, OPEN, SEP, argument_type, unescape_attr
from sglang.srt.parsers import grammar_text as g
from sglang.srt.parsers.marker_buffer import find_first, held_suffix
from sglang.srt.parsers.tool_call import (
    ToolCallParser,
    ToolParseResult,
    dump_arguments,
    json_value,
)

RESPONSE_OPEN = f"{OPEN}response{SEP}"
RESPONSE_CLOSE = f"{CLOSE}response{SEP}"
TOOLS_OPEN = f"{OPEN}tools{SEP}"
TOOLS_CLOSE = f"{CLOSE}tools{SEP}"
CALL_CLOSE = f"{CLOSE}call{SEP}"
MESSAGE_CLOSE = f"{CLOSE}message{SEP}"
_CALL_HEADER = re.compile(re.escape(OPEN) + r"\s*call((?:\s+\w+=\"[^\"]*\")*)\s*" + re.escape(SEP))
_ATTR = re.compile(r'(\w+)="([^"]*)"')
_ARG = re.compile(
    re.escape(OPEN)
    + r"\s*argument((?:\s+\w+=\"[^\"]*\")*)\s*"
    + re.escape(SEP)
    + r"(.*?)"
    + re.escape(f"{CLOSE}argument{SEP}"),
    re.DOTALL,
)
_RAW_JSON = re.compile(
    re.escape(OPEN) + r"\s*json[^<]*" + re.escape(SEP) + r"(.*?)" + re.escape(f"{CLOSE}json{SEP}"),
    re.DOTALL,
)
_CONTENT_ENDS = (RESPONSE_CLOSE, TOOLS_OPEN, MESSAGE_CLOSE)


def _attrs(text: str) -> dict[str, str]:
    return {k: unescape_attr(v) for k, v in _ATTR.findall(text)}


def parse_arguments(body: str) -> dict[str, Any]:
    raw = _RAW_JSON.search(body)
    if raw is not None:
        value = json_value(raw.group(1))
        return value if isinstance(value, dict) else {"arguments": raw.group(1)}
    args: dict[str, Any] = {}
    for attr_text, value in _ARG.findall(body):
        attrs = _attrs(attr_text)
        key = attrs.get("key", "")
        args[key] = value if attrs.get("type", "string") == "string" else json_value(value)
    return args


class KimiK3ToolCallParser(ToolCallParser):
    markers = (OPEN, CLOSE, SEP, END_OF_MSG)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state = "start"  # start, response, between, tools, end

    def call_id(self, name: str, index: int) -> str:
        return f"functions.{name}:{index}"

    def feed(self, text: str) -> ToolParseResult:
        self._buf += text
        out = ToolParseResult()
        while self._step(out):
            pass
        return out

    def _step(self, out: ToolParseResult) -> bool:
        state, buf = self._state, self._buf
        if state == "start":  # the response channel opens here when thinking was on
            head = buf.lstrip()
            if RESPONSE_OPEN.startswith(head) and len(head) < len(RESPONSE_OPEN):
                return False
            if head.startswith(RESPONSE_OPEN):
                self._buf = head[len(RESPONSE_OPEN) :]
            self._state = "response"
            return True
        if state == "response":
            pos, marker = find_first(buf, _CONTENT_ENDS)
            if marker is None:
                hold = held_suffix(buf, _CONTENT_ENDS)
                out.content += buf[: len(buf) - hold]
                self._buf = buf[len(buf) - hold :]
                return False
            out.content += buf[:pos]
            self._buf = buf[pos + len(marker) :]
            self._state = {TOOLS_OPEN: "tools", MESSAGE_CLOSE: "end"}.get(marker, "between")
            return True
        if state == "between":
            self._buf = buf = buf.lstrip()
            for marker, nxt in (
                (TOOLS_OPEN, "tools"),
                (MESSAGE_CLOSE, "end"),
                (RESPONSE_OPEN, "response"),
            ):
                if buf.startswith(marker):
                    self._buf, self._state = buf[len(marker) :], nxt
                    return True
            if not buf or any(
                m.startswith(buf) for m in (TOOLS_OPEN, MESSAGE_CLOSE, RESPONSE_OPEN)
            ):
                return False
            self._state = "response"  # text outside any channel: show it as content
            return True
        if state == "tools":
            return self._step_tools(out)
        self._buf = ""  # "end": the message is closed; the rest is the end-of-message token
        return False

    def _step_tools(self, out: ToolParseResult) -> bool:
        if self._name is None:
            self._buf = buf = self._buf.lstrip()
            if buf.startswith(TOOLS_CLOSE):
                self._buf, self._state = buf[len(TOOLS_CLOSE) :], "between"
                return True
            header = _CALL_HEADER.match(buf)
            if header is None:
                if buf.startswith(OPEN):
                    if SEP not in buf:
                        return False  # the tag is not complete yet
                    self._buf = buf[buf.index(SEP) + len(SEP) :]  # another element: skip its tag
                    return True
                nxt = buf.find(OPEN)
                if nxt < 0:  # stray text in the channel: drop it, keep a marker's start
                    self._buf = buf[len(buf) - held_suffix(buf, (OPEN, TOOLS_CLOSE)) :]
                    return False
                self._buf = buf[nxt:]
                return True
            self._name = _attrs(header.group(1)).get("tool", "")
            self._buf = buf[header.end() :]
            out.deltas += self.begin_call(self._name)
        return self.close_call_at(out, CALL_CLOSE, parse_arguments)

    def finish(self) -> ToolParseResult:
        out = ToolParseResult()
        if self._state in ("start", "response") and not self._buf.lstrip().startswith("<|"):
            out.content = self._buf
        elif self._state == "tools" and self._name:
            out.deltas += self.end_call(self._name, dump_arguments(parse_arguments(self._buf)))
        self._buf, self._name = "", None
        return out


def _call_grammar(tool: Mapping[str, Any], index: Any) -> Any:
    fn = tool["function"]
    args = []
    for key, schema, required in g.properties(fn.get("parameters")):
        is_str = g.is_string_schema(schema)
        kind = "string" if is_str else _schema_kind(schema)
        head = g.literal(f'{OPEN}argument key="{key}" type="{kind}"{SEP}')
        value = g.raw_string(schema) if is_str else g.json_value(schema)
        arg = g.seq(head, value, g.literal(f"{CLOSE}argument{SEP}"))
        args.append(arg if required else g.optional(arg))
    head = g.seq(g.literal(f'{OPEN}call tool="{fn["name"]}" index="'), index, g.literal(f'"{SEP}'))
    return g.seq(head, *args, g.literal(CALL_CLOSE))


def _schema_kind(schema: Any) -> str:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    example = {"integer": 0, "number": 0, "boolean": True, "null": None, "array": []}
    return argument_type(example.get(kind, {})) if isinstance(kind, str) else "object"


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]], choice: ToolChoice, parallel: bool, thinking: bool
) -> str:
    """EBNF for the answer when a call is required: an empty response channel, then the tools
    channel with one call (of the named function, or of any tool), or several when
    ``parallel``, then the message close."""
    chosen = [t for t in tools if choice.mode != "function" or t["function"]["name"] == choice.name]
    many = parallel and choice.mode != "function"
    index = g.regex("[1-9][0-9]*") if many else g.literal("1")
    call = g.choice(*(_call_grammar(t, index) for t in chosen))
    calls = g.repeat(call) if many else call
    opening = (RESPONSE_OPEN if thinking else "") + RESPONSE_CLOSE + TOOLS_OPEN
    grammar = g.seq(g.literal(opening), calls, g.literal(TOOLS_CLOSE + MESSAGE_CLOSE))
    return str(grammar)
