"""The chat API end to end on CPU: the server on the built-in model (random weights, DeepSeek V4
encoding), driven by the official ``openai`` client. Tool calls (plain and streamed, required and
named), ``response_format`` JSON schemas (valid JSON matching the schema even from random
weights), reasoning on and off with a thinking budget, structured output on ``/generate``, and
hostile inputs (huge, deep or recursive schemas, unknown tools) answered with a 400 naming the
problem while the server keeps serving."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file
from sglang.test.server_process import ServerProcess

register_cpu_ci(est_time=60)

MODEL = "sglang-default-tiny-dsv4"
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
THINK = {"chat_template_kwargs": {"thinking": True}}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}},
]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # Short whitespace runs keep random-weight JSON short; the limit itself is tested here too.
    os.environ["SGLANG_GRAMMAR_MAX_WHITESPACE"] = "1"
    try:
        s = ServerProcess("--device", "cpu", "--random-seed", "0", "--log-level", "warning")
    finally:
        del os.environ["SGLANG_GRAMMAR_MAX_WHITESPACE"]
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    extra = {**kw.pop("extra_body", {})}
    return client.chat.completions.create(
        model=MODEL, messages=kw.pop("messages", ASK), extra_body=extra, **kw
    )


def _matches_schema(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"ok", "n", "tag"}
        and isinstance(value["ok"], bool)
        and isinstance(value["n"], int)
        and 0 <= value["n"] <= 9
        and re.fullmatch("[a-z]{1,4}", value["tag"]) is not None
    )


def _weather_args(arguments: str) -> bool:
    args = json.loads(arguments)
    return args["city"] in ("Paris", "Tokyo") and 1 <= args["days"] <= 7


def test_required_tool_call(client: openai.OpenAI) -> None:
    # One call: several are covered by the grammar tests, and each costs ~70 CPU steps here.
    kw = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    out = _chat(client, max_tokens=120, **kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name in ("get_weather", "ping")
        if call.function.name == "get_weather":
            assert _weather_args(call.function.arguments), call.function.arguments
        else:
            assert json.loads(call.function.arguments) == {}


def test_named_tool_call_streamed(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = {"tools": TOOLS, "tool_choice": choice, "max_tokens": 120, "parallel_tool_calls": False}
    calls: dict[int, dict[str, str]] = {}
    content, reasons = "", []
    for chunk in _chat(client, stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
        for tc in delta.tool_calls or []:
            got = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            got["name"] += (tc.function and tc.function.name) or ""
            got["arguments"] += (tc.function and tc.function.arguments) or ""
    assert content == "" and reasons[-1] == "tool_calls"  # no markup ever reached the content
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert _weather_args(calls[0]["arguments"]), calls


def test_json_schema_from_random_weights(client: openai.OpenAI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    out = _chat(client, response_format=rf, max_tokens=80, n=2, seed=3, temperature=1.0)
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        assert _matches_schema(choice.message.content), choice.message.content
    obj = _chat(client, response_format={"type": "json_object"}, max_tokens=40)
    assert obj.choices[0].message.content.lstrip().startswith("{")


def test_reasoning_on_and_off(client: openai.OpenAI) -> None:
    off = _chat(client, max_tokens=6).choices[0].message
    assert off.reasoning_content is None and off.content
    budget = {**THINK, "thinking_budget": 3}
    on = _chat(client, max_tokens=10, extra_body=budget)
    msg = on.choices[0].message
    assert msg.reasoning_content and isinstance(msg.content, str)
    assert on.usage.completion_tokens == 10  # 3 reasoning + </think> + the answer
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in _chat(client, max_tokens=10, stream=True, extra_body=budget):
        delta = chunk.choices[0].delta
        for key in streamed:
            streamed[key] += getattr(delta, key, None) or (delta.model_extra or {}).get(key) or ""
    assert streamed == {"reasoning_content": msg.reasoning_content, "content": msg.content}
    # The grammar applies to the answer only, after the reasoning (ended by the budget).
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    both = _chat(client, max_tokens=80, response_format=rf, extra_body=budget).choices[0]
    assert both.message.reasoning_content and _matches_schema(both.message.content)


def test_tool_turns_pass_back(client: openai.OpenAI) -> None:
    """A follow-up turn with the call, its result and the reasoning passed back."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "r"},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    out = _chat(client, messages=messages, tools=TOOLS, max_tokens=4, extra_body=THINK)
    assert out.usage.prompt_tokens > 100 and out.choices[0].finish_reason == "length"
    raw = dict(call, function={"name": "get_weather", "arguments": "not json"})
    malformed = [*ASK, {"role": "assistant", "tool_calls": [raw]}]
    assert _chat(client, messages=malformed, tools=TOOLS, max_tokens=2).choices[0].message


def test_generate_structured_and_separate_reasoning(server: ServerProcess) -> None:
    params = {"max_new_tokens": 24, "temperature": 0, "regex": "[a-c]{2}-[0-9]{1,3}"}
    out = httpx.post(f"{server.base_url}/generate", json={"text": "hi", "sampling_params": params})
    assert out.status_code == 200 and re.fullmatch("[a-c]{2}-[0-9]{1,3}", out.json()["text"])
    body = {
        "text": "hi",
        "separate_reasoning": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "thinking_budget": 2},
    }
    got = httpx.post(f"{server.base_url}/generate", json=body).json()
    assert got["meta_info"]["completion_tokens"] == 8 and "reasoning_text" in got
    assert "</think>" not in got["text"] and "</think>" not in got["reasoning_text"]


def _deep_schema(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"x": node}}
    return node


RECURSIVE = {
    "$defs": {"node": {"type": "object", "properties": {"kid": {"$ref": "#/$defs/node"}}}},
    "$ref": "#/$defs/node",
}


def _rf(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"response_format": _rf({"type": "nope"})}, 'Unsupported type "nope"'),
        ({"response_format": _rf({"enum": ["x" * 70000]})}, "over the limit"),
        ({"response_format": _rf(_deep_schema(20))}, "nests deeper"),
        ({"response_format": _rf(RECURSIVE)}, "recursive"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "'x'"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "given twice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "t", "parameters": RECURSIVE}}],
                "tool_choice": "required",
            },
            "tool 't'",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": _rf(SCHEMA)}, "drop one"),
        ({"chat_template_kwargs": {"thinking": True}, "thinking_budget": -1}, "thinking_budget"),
    ],
)
def test_hostile_requests_get_a_named_400(
    server: ServerProcess, body: dict[str, Any], needle: str
) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 2, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text
    good = httpx.post(
        f"{server.base_url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    )
    assert good.status_code == 200 and good.json()["meta_info"]["completion_tokens"] == 2


def test_bad_generate_grammar(server: ServerProcess) -> None:
    for params, needle in (
        ({"ebnf": "root ::= nope"}, "invalid ebnf"),
        ({"regex": "(", "json_schema": "{}"}, "at most one"),
    ):
        r = httpx.post(f"{server.base_url}/generate", json={"text": "x", "sampling_params": params})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


if __name__ == "__main__":
    run_this_file(__file__)
