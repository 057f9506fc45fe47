"""DeepSeek V4's tool calls (DSML), parsed from the streamed content, and the grammar that
makes ``tool_choice`` ``required`` or a named function hold::

    {content}\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls><｜end▁of▁sentence｜>

``string="true"`` values are raw text, the others JSON.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from sglang.srt.chat.deepseek_v4 import (
    DSML,
    INVOKE_END,
    INVOKE_START,
    PARAM_END,
    PARAM_START,
    TOOL_CALLS_END,
    TOOL_CALLS_START,
)
from sglang.srt.chat.encoding import ToolChoice
from sglang.srt.parsers import grammar_text as g
from sglang.srt.parsers.marker_buffer import held_suffix
from sglang.srt.parsers.tool_call import (
    ToolCallParser,
    ToolParseResult,
    dump_arguments,
    json_value,
)

BLOCK_OPENING = "\n\n" + TOOL_CALLS_START
_HEADER = re.compile(r'\s*name="([^"]*)"\s*>\n?', re.DOTALL)
_PARAM = re.compile(
    re.escape(PARAM_START)
    + r'\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)'
    + re.escape(PARAM_END),
    re.DOTALL,
)


def parse_parameters(body: str) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for name, is_str, value in _PARAM.findall(body):
        args[name] = value if is_str == "true" else json_value(value)
    return args


class DeepseekV4ToolCallParser(ToolCallParser):
    markers = (DSML, TOOL_CALLS_START, TOOL_CALLS_END, INVOKE_END, PARAM_END)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_block = False

    def feed(self, text: str) -> ToolParseResult:
        self._buf += text
        out = ToolParseResult()
        while True:
            if not self._in_block:
                pos = self._buf.find(TOOL_CALLS_START)
                if pos < 0:
                    hold = held_suffix(self._buf, (BLOCK_OPENING, TOOL_CALLS_START))
                    out.content += self._buf[: len(self._buf) - hold]
                    self._buf = self._buf[len(self._buf) - hold :]
                    return out
                before = self._buf[:pos]
                for _ in range(2):  # the "\n\n" that opens the block is not content
                    before = before.removesuffix("\n")
                out.content += before
                self._buf, self._in_block = self._buf[pos + len(TOOL_CALLS_START) :], True
            if not self._step_block(out):
                return out

    def _step_block(self, out: ToolParseResult) -> bool:
        """Consume one piece of the block; False when more text is needed."""
        if self._name is None:
            self._buf = self._buf.lstrip()
            if self._buf.startswith(TOOL_CALLS_END):
                self._buf, self._in_block = self._buf[len(TOOL_CALLS_END) :], False
                return True
            if not self._buf.startswith(INVOKE_START):
                nxt = self._buf.find("<", 1)
                if not self._buf or any(
                    m.startswith(self._buf) for m in (INVOKE_START, TOOL_CALLS_END)
                ):
                    return False
                self._buf = "" if nxt < 0 else self._buf[nxt:]  # stray text inside the block
                return True
            header = _HEADER.match(self._buf, len(INVOKE_START))
            if header is None:
                if ">" in self._buf:  # a header that is not name="...": skip the invoke
                    self._name = ""
                    self._buf = self._buf[self._buf.index(">") + 1 :]
                    return True
                return False
            self._name = header.group(1)
            self._buf = self._buf[header.end() :]
            out.deltas += self.begin_call(self._name)
        return self.close_call_at(out, INVOKE_END, parse_parameters)

    def finish(self) -> ToolParseResult:
        out = ToolParseResult()
        if not self._in_block:
            if not self._buf.strip():
                out.content = self._buf
        elif self._name:  # cut short inside an invoke: close it with the parameters so far
            out.deltas += self.end_call(self._name, dump_arguments(parse_parameters(self._buf)))
        self._buf, self._name = "", None
        return out


def _invoke_grammar(tool: Mapping[str, Any]) -> Any:
    fn = tool["function"]
    params = []
    for key, schema, required in g.properties(fn.get("parameters")):
        is_str = g.is_string_schema(schema)
        head = g.literal(f'{PARAM_START} name="{key}" string="{"true" if is_str else "false"}">')
        value = g.raw_string(schema) if is_str else g.json_value(schema)
        param = g.seq(head, value, g.literal(f"{PARAM_END}\n"))
        params.append(param if required else g.optional(param))
    body = g.seq(*params) if params else g.literal("\n")
    return g.seq(g.literal(f'{INVOKE_START} name="{fn["name"]}">\n'), body, g.literal(INVOKE_END))


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]], choice: ToolChoice, parallel: bool, thinking: bool
) -> str:
    """EBNF for the answer when a call is required: a tool_calls block of one call (of the
    named function, or of any tool), or of several when ``parallel``, and nothing else. It
    applies after the reasoning, so ``thinking`` changes nothing here."""
    chosen = [t for t in tools if choice.mode != "function" or t["function"]["name"] == choice.name]
    invoke = g.choice(*(_invoke_grammar(t) for t in chosen))
    calls = g.repeat(invoke, "\n") if parallel and choice.mode != "function" else invoke
    grammar = g.seq(g.literal(BLOCK_OPENING + "\n"), calls, g.literal("\n" + TOOL_CALLS_END))
    return str(grammar)
