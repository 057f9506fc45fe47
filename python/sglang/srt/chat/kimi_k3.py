"""Kimi K3's chat encoding ("XTML"), written from the format its model repository publishes (the
render program behind the tokenizer's ``apply_chat_template``) and the prompts documented for it.

Every turn is an element built from four control tokens::

    <|open|>message role="user"<|sep|>Hello<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|>
      <|open|>think<|sep|>{reasoning}<|close|>think<|sep|>          (thinking mode only)
      <|open|>response<|sep|>{content}<|close|>response<|sep|>
      <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
        <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
      <|close|>call<|sep|><|close|>tools<|sep|>
    <|close|>message<|sep|><|end_of_msg|>

Tools are declared in a ``tool-declare`` system turn (deep-sorted, compact JSON); the thinking
effort, ``tool_choice`` ``required``/``none`` and a JSON ``response_format`` are stated in system
turns of their own. Every assistant turn keeps its reasoning in thinking mode. The markers are
control tokens; everything else (tag names, attributes, client text) is tokenized as text, one
segment at a time, so text the client sends can never become structure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sglang.srt.chat.encoding import (
    ChatEncoding,
    ChatEncodingError,
    ChatOptions,
    ChatPrompt,
    PromptSegment,
)

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
THINKING_EFFORTS = ("low", "high", "max")
# OpenAI's reasoning_effort values -> K3's thinking efforts ("none" turns thinking off).
_EFFORT_FROM_OPENAI = {
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "max": "max",
    "xhigh": "max",
}


def deep_sort(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: deep_sort(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [deep_sort(v) for v in value]
    return value


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def argument_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


class _Segments:
    def __init__(self) -> None:
        self.out: list[PromptSegment] = []

    def control(self, text: str) -> None:
        self.out.append(PromptSegment(text, special=True))

    def text(self, text: str) -> None:
        if text:
            self.out.append(PromptSegment(text, special=False))

    def open(self, tag: str, attrs: Sequence[tuple[str, str]] = ()) -> None:
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs:
            self.text(f" {key}")
            self.text('="')
            self.text(escape_attr(value))
            self.text('"')
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def close_message(self) -> None:
        self.close("message")
        self.control(END_OF_MSG)

    def system(self, kind: str, body: str) -> None:
        self.open("message", [("role", "system"), ("type", kind)])
        self.text(body)
        self.close_message()


def _role_attrs(role: str, m: Mapping[str, Any]) -> list[tuple[str, str]]:
    attrs = [("role", role)]
    if m.get("name"):
        attrs.append(("name", str(m["name"])))
    return attrs


def _declare_tools(out: _Segments, tools: Sequence[Mapping[str, Any]], dynamic: bool) -> None:
    schemas = compact_json(deep_sort(list(tools)))
    if dynamic:
        body = (
            "## New Tools Available\n"
            "The system dynamically extends the toolset via lazy-loading.\n"
            "You have access to all existing and extended tools.\n"
            "Here are the specs for the extended tools.\n\n"
            f"```json\n{schemas}\n```"
        )
    else:
        body = (
            "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
            f"```json\n{schemas}\n```"
        )
    out.system("tool-declare", body)


def _arguments(raw: Any, where: str) -> dict[str, Any] | str:
    """A call's arguments as an object, or the raw text when it is not JSON (rendered as a
    ``json`` block)."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return str(raw)
    if not isinstance(parsed, dict):
        raise ChatEncodingError(f"{where}: tool call arguments must be a JSON object")
    return parsed


def _render_calls(out: _Segments, calls: Sequence[Mapping[str, Any]], where: str) -> None:
    out.open("tools")
    for i, call in enumerate(calls, start=1):
        fn = call["function"]
        out.open("call", [("tool", fn["name"]), ("index", str(i))])
        args = _arguments(fn.get("arguments"), f"{where}.tool_calls[{i - 1}]")
        if isinstance(args, str):
            out.open("json", [("type", "object")])
            out.text(args)
            out.close("json")
        else:
            for key, value in args.items():
                out.open("argument", [("key", key), ("type", argument_type(value))])
                out.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                out.close("argument")
        out.close("call")
    out.close("tools")


def _sort_tool_results(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each run of tool results follows the order of the calls of the assistant turn before it,
    matched by ``tool_call_id``; a matched result takes the name of its call. A run with a
    result that matches no call is left as it came."""
    out: list[dict[str, Any]] = []
    calls: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] != "tool":
            if m["role"] == "assistant":
                calls = {}
                for k, c in enumerate(m.get("tool_calls") or [], start=1):
                    calls.setdefault(c["id"], (k, c["function"]["name"]))
            out.append(dict(m))
            i += 1
            continue
        run = []
        while i < len(messages) and messages[i]["role"] == "tool":
            run.append(dict(messages[i]))
            i += 1
        if all(r.get("tool_call_id") in calls for r in run):
            run.sort(key=lambda r: calls[r["tool_call_id"]][0])  # stable: ties keep arrival order
            for r in run:
                r["tool"] = calls[r["tool_call_id"]][1]
        out.extend(run)
    return out


def response_schema(response_format: Mapping[str, Any]) -> Any:
    js = response_format.get("json_schema")
    if isinstance(js, Mapping):
        return js.get("schema", js.get("json_schema", js))
    return js


class KimiK3Encoding(ChatEncoding):
    name = "kimi-k3"
    default_thinking = True
    reasoning_parser = "kimi-k3"
    tool_call_parser = "kimi-k3"
    marker_tokens = (OPEN, CLOSE, SEP, END_OF_MSG)

    def _effort(self, options: ChatOptions) -> str | None:
        kwargs = options.template_kwargs
        if "thinking_effort" in kwargs:
            effort = kwargs["thinking_effort"]
            if effort is not None and effort not in THINKING_EFFORTS:
                raise ChatEncodingError(
                    f"chat_template_kwargs.thinking_effort must be one of {THINKING_EFFORTS} or "
                    f"null, got {effort!r}"
                )
            return effort  # type: ignore[no-any-return]
        if options.reasoning_effort is None:
            return "max"
        effort = _EFFORT_FROM_OPENAI.get(options.reasoning_effort)
        if effort is None:
            raise ChatEncodingError(
                f"reasoning_effort {options.reasoning_effort!r} is not one of "
                f"{sorted({*_EFFORT_FROM_OPENAI, 'none'})}"
            )
        return effort

    def render(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions) -> ChatPrompt:
        thinking = self.thinking_enabled(options)
        out = _Segments()
        if options.tools:
            _declare_tools(out, options.tools, dynamic=False)
        if thinking:
            effort = self._effort(options)
            if effort is not None:
                out.system(
                    "thinking-effort",
                    "`thinking_effort` guides on how much to think in your thinking channel "
                    "(not including the response channel), supported values include `low`, "
                    "`medium`, `high`, and `max`.\n"
                    f"Now the system is invoked with `thinking_effort={effort}`.",
                )
        last_calls: list[Mapping[str, Any]] = []
        tool_index = 0
        for i, m in enumerate(_sort_tool_results(messages)):
            role = m["role"]
            if role in ("user", "system"):
                out.open("message", _role_attrs(role, m))
                out.text(m.get("content") or "")
                out.close_message()
            elif role == "tool":
                tool_index += 1
                name = m.get("tool") or m.get("name")
                if not name and tool_index <= len(last_calls):
                    name = last_calls[tool_index - 1]["function"]["name"]
                if not name:
                    raise ChatEncodingError(
                        f"messages[{i}]: a tool result needs the name of its tool: give "
                        "tool_call_id (or name) matching a call of the assistant turn before it"
                    )
                attrs = [("role", "tool"), ("tool", str(name)), ("index", str(tool_index))]
                out.open("message", attrs)
                out.text(m.get("content") or "")
                out.close_message()
            elif role == "assistant":
                last_calls, tool_index = list(m.get("tool_calls") or []), 0
                out.open("message", _role_attrs("assistant", m))
                if thinking:
                    out.open("think")
                    reasoning = m.get("reasoning_content") or ""
                    if reasoning.strip():
                        out.text(reasoning)
                    out.close("think")
                out.open("response")
                out.text(m.get("content") or "")
                out.close("response")
                if last_calls:
                    _render_calls(out, last_calls, f"messages[{i}]")
                out.close_message()
        choice = options.tool_choice.mode
        if choice == "required":
            out.system(
                "tool-choice",
                "The system is invoked with `tool_choice=required`.\n"
                "You MUST call tools in the next message.",
            )
        elif choice == "none" and options.tools:
            out.system(
                "tool-choice",
                "The system is invoked with `tool_choice=none`.\n"
                "You MUST NOT call any tools in the next message.",
            )
        rf = options.response_format
        rf_type = rf.get("type") if rf is not None else None
        rule = (
            "Your response must be raw JSON data without markdown code blocks (```json) or any "
            "additional formatting."
        )
        if rf_type == "json_object":
            out.system(
                "response-format",
                f"The system is invoked with `response_format=json_object`.\n{rule}",
            )
        elif rf_type == "json_schema":
            schema = compact_json(deep_sort(response_schema(rf)))  # type: ignore[arg-type]
            out.system(
                "response-format",
                f"The system is invoked with `response_format=json_schema`.\n{rule}\n"
                f"The JSON data must match the following schema:\n```json\n{schema}\n```",
            )
        out.open("message", [("role", "assistant")])
        out.open("think" if thinking else "response")
        return ChatPrompt(tuple(out.out), thinking)

    def content_affixes(self, thinking: bool) -> tuple[str, str]:
        opened = "" if not thinking else f"{OPEN}response{SEP}"
        return opened, f"{CLOSE}response{SEP}{CLOSE}message{SEP}"
