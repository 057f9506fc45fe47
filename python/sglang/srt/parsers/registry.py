"""Parsers by name (``--reasoning-parser``, ``--tool-call-parser``), one per model format."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sglang.srt.chat.deepseek_v4 import THINK_END, THINK_START
from sglang.srt.chat.encoding import ToolChoice
from sglang.srt.chat.kimi_k3 import CLOSE, OPEN, SEP
from sglang.srt.parsers.reasoning import ReasoningFormat
from sglang.srt.parsers.tool_call import ToolCallParser
from sglang.srt.utils.registry import Registry

REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-v4": ReasoningFormat(
        "deepseek-v4", THINK_START, THINK_END, implicit_ends=("<｜DSML｜tool_calls>",)
    ),
    "kimi-k3": ReasoningFormat(
        "kimi-k3",
        f"{OPEN}think{SEP}",
        f"{CLOSE}think{SEP}",
        implicit_ends=(f"{OPEN}response{SEP}", f"{OPEN}tools{SEP}"),
    ),
}

# (tools, tool choice, parallel calls allowed, thinking) -> EBNF of a required call.
GrammarBuilder = Callable[[Sequence[Mapping[str, Any]], ToolChoice, bool, bool], str]


@dataclass(frozen=True)
class ToolCallFormat:
    parser: type[ToolCallParser]
    grammar: GrammarBuilder


TOOL_CALL_FORMATS: Registry[ToolCallFormat] = Registry("tool-call parser")


@TOOL_CALL_FORMATS.register("deepseek-v4")
def _deepseek_v4() -> ToolCallFormat:
    from sglang.srt.parsers import deepseek_v4_tool_calls as m

    return ToolCallFormat(m.DeepseekV4ToolCallParser, m.tool_call_grammar)


@TOOL_CALL_FORMATS.register("kimi-k3")
def _kimi_k3() -> ToolCallFormat:
    from sglang.srt.parsers import kimi_k3_tool_calls as m

    return ToolCallFormat(m.KimiK3ToolCallParser, m.tool_call_grammar)


def reasoning_parser_names() -> tuple[str, ...]:
    return tuple(sorted(REASONING_FORMATS))


def tool_call_parser_names() -> tuple[str, ...]:
    return TOOL_CALL_FORMATS.names()
