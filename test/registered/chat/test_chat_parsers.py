"""Reasoning and tool-call parsers on crafted model outputs, streamed with the chunk boundary at
every position (and one character at a time): the reasoning, content and calls read back are
the same however the text is cut, so no partial markup ever reaches the content; calls to unknown
tools, calls that tool_choice or parallel_tool_calls rule out, malformed arguments and outputs cut
short are handled as documented."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Sequence
from typing import Any

import pytest

from sglang.srt.chat.encoding import ToolChoice
from sglang.srt.chat.messages import check_tools
from sglang.srt.parsers.chat_output import ChatOutputParser
from sglang.srt.parsers.reasoning import ReasoningParser
from sglang.srt.parsers.registry import REASONING_FORMATS, TOOL_CALL_FORMATS
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=6)

TOOLS = check_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        },
        {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
    ]
)


def _parser(fmt: str, thinking: bool, **kw: Any) -> ChatOutputParser:
    reasoning = ReasoningParser(REASONING_FORMATS[fmt], in_reasoning=True) if thinking else None
    tools = TOOL_CALL_FORMATS.create(fmt).parser(kw.pop("tools", TOOLS), **kw)
    return ChatOutputParser(reasoning, tools)


def _stream(
    fmt: str, text: str, cuts: Sequence[int], thinking: bool = True, **kw: Any
) -> dict[str, Any]:
    """Feed ``text`` cut at ``cuts``; everything the client would see."""
    p = _parser(fmt, thinking, **kw)
    reasoning, content, deltas = [], [], []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in itertools.pairwise(bounds):
        d = p.feed(text[a:b])
        reasoning.append(d.reasoning)
        content.append(d.content)
        deltas += d.tool_calls
    d = p.finish()
    reasoning.append(d.reasoning)
    content.append(d.content)
    deltas += d.tool_calls
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:  # rebuild the calls the way a streaming client does
        call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
        fn = delta.get("function", {})
        call["name"] += fn.get("name") or ""
        call["arguments"] += fn.get("arguments") or ""
    return {
        "reasoning": "".join(reasoning),
        "content": "".join(content),
        "content_pieces": content,
        "streamed_calls": [calls[i] for i in sorted(calls)],
        "calls": [c["function"] for c in p.tool_calls],
        "invalid": p.invalid_tool_calls,
    }


def _every_cut(fmt: str, text: str, thinking: bool = True, **kw: Any) -> dict[str, Any]:
    """The result of one unsplit feed, checked equal under every split (one cut anywhere, one
    character at a time, random multi-cuts)."""
    whole = _stream(fmt, text, [], thinking, **kw)
    rng = random.Random(0)
    cut_sets = [[i] for i in range(len(text) + 1)]
    cut_sets.append(list(range(len(text))))
    cut_sets += [rng.sample(range(len(text)), k=min(len(text), 12)) for _ in range(20)]
    for cuts in cut_sets:
        got = _stream(fmt, text, cuts, thinking, **kw)
        for key in ("reasoning", "content", "calls", "invalid"):
            assert got[key] == whole[key], (key, cuts, got[key], whole[key])
        assert got["streamed_calls"] == whole["calls"], cuts
    return whole


DSML_OUTPUT = (
    "Check the <b>weather</b> and\n\nsearch.</think>Sure — one moment\n\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris <"x"></｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="nope">\n'
    '<｜DSML｜parameter name="q" string="true">x</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="search">\n'
    '<｜DSML｜parameter name="opts" string="false">{bad json</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)


def test_dsv4_calls_at_every_chunk_boundary() -> None:
    got = _every_cut("deepseek-v4", DSML_OUTPUT)
    assert got["reasoning"] == "Check the <b>weather</b> and\n\nsearch."
    assert got["content"] == "Sure — one moment"
    assert got["calls"] == [
        {"name": "get_weather", "arguments": json.dumps({"city": 'Paris <"x">', "days": 3})},
        # A value written as JSON that does not parse is passed as a JSON string of its text.
        {"name": "search", "arguments": json.dumps({"opts": "{bad json"})},
    ]
    assert [c["name"] for c in got["invalid"]] == ["nope"]
    assert "unknown tool 'nope'" in got["invalid"][0]["error"]


def test_dsv4_content_only_and_implicit_end_of_reasoning() -> None:
    plain = _every_cut("deepseek-v4", "thinking <thi</think>just text <｜end > and\n\n", True)
    assert plain["reasoning"] == "thinking <thi" and plain["calls"] == []
    assert plain["content"] == "just text <｜end > and\n\n"  # no block followed: shown at the end
    # The model opened its tool calls without closing the reasoning.
    text = 'plan\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="search">\n</｜DSML｜invoke>\n'
    got = _every_cut("deepseek-v4", text + "</｜DSML｜tool_calls>")
    assert got["reasoning"] == "plan\n\n" and got["content"] == ""
    assert got["calls"] == [{"name": "search", "arguments": "{}"}]
    off = _every_cut("deepseek-v4", "<think>not reasoning", thinking=False)
    assert off["content"] == "<think>not reasoning" and off["reasoning"] == ""


@pytest.mark.parametrize(
    ("kw", "valid", "why"),
    [
        ({"parallel": False}, ["get_weather"], "parallel_tool_calls"),
        ({"choice": ToolChoice("function", "search")}, ["search"], "tool_choice names"),
        ({"choice": ToolChoice("none")}, [], "tools are off"),
        ({"tools": ()}, [], "tools are off"),
    ],
)
def test_dsv4_calls_the_request_rules_out(kw: dict[str, Any], valid: list[str], why: str) -> None:
    got = _every_cut("deepseek-v4", DSML_OUTPUT, **kw)
    assert [c["name"] for c in got["calls"]] == valid
    assert any(why in c["error"] for c in got["invalid"])
    assert got["content"] == "Sure — one moment"  # never the markup


def test_dsv4_output_cut_short_inside_a_call() -> None:
    text = DSML_OUTPUT.split('<｜DSML｜parameter name="days"')[0]
    got = _every_cut("deepseek-v4", text)
    assert got["calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris <\\"x\\">"}'}]
    assert got["content"] == "Sure — one moment"


K3_OUTPUT = (
    "Plan: <call> the tool.<|close|>think<|sep|>"
    "<|open|>response<|sep|>On it <|open|> — here.<|close|>response<|sep|>"
    "<|open|>tools<|sep|>"
    '<|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Pa"ris<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
    '<|open|>call tool="missing" index="2"<|sep|><|close|>call<|sep|>'
    '<|open|>call tool="search" index="3"<|sep|>'
    '<|open|>json type="object"<|sep|>{"q": "k3", "n": [1]}<|close|>json<|sep|>'
    "<|close|>call<|sep|>"
    "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
)


def test_k3_channels_at_every_chunk_boundary() -> None:
    got = _every_cut("kimi-k3", K3_OUTPUT)
    assert got["reasoning"] == "Plan: <call> the tool."
    assert got["content"] == "On it <|open|> — here."
    assert got["calls"] == [
        {"name": "get_weather", "arguments": json.dumps({"city": 'Pa"ris', "days": 2})},
        {"name": "search", "arguments": json.dumps({"q": "k3", "n": [1]})},
    ]
    assert [c["name"] for c in got["invalid"]] == ["missing"]


def test_k3_ids_thinking_off_and_implicit_ends() -> None:
    p = _parser("kimi-k3", True, id_offset=3)
    p.finish(K3_OUTPUT)
    assert [c["id"] for c in p.tool_calls] == ["functions.get_weather:3", "functions.search:4"]
    off = _every_cut(
        "kimi-k3", "Just <b>this</b>.<|close|>response<|sep|><|close|>message<|sep|>", False
    )
    assert off["content"] == "Just <b>this</b>." and off["reasoning"] == ""
    skipped = _every_cut("kimi-k3", "hmm<|open|>response<|sep|>answer<|close|>response<|sep|>")
    assert skipped["reasoning"] == "hmm" and skipped["content"] == "answer"
    cut = _every_cut("kimi-k3", K3_OUTPUT.split('<|open|>argument key="days"')[0])
    assert cut["calls"] == [{"name": "get_weather", "arguments": '{"city": "Pa\\"ris"}'}]


def test_reasoning_that_never_closes_and_markers() -> None:
    got = _every_cut("deepseek-v4", "still thinking </thin")
    assert got["reasoning"] == "still thinking </thin" and got["content"] == ""
    p = _parser("kimi-k3", True)
    assert {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"} <= set(p.markers)
    assert "｜DSML｜" in _parser("deepseek-v4", True).markers


if __name__ == "__main__":
    run_this_file(__file__)
