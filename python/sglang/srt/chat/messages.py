"""OpenAI chat messages, tools and tool choice -> the plain dicts and values the encodings take.

Messages become ``{"role", "content", ...}`` dicts: text content parts joined, ``developer`` read
as ``system`` (both formats keep their own developer role for internal pipelines), tool-call
arguments as JSON strings, ``reasoning`` accepted as a spelling of ``reasoning_content``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sglang.srt.chat.encoding import ChatEncodingError, ToolChoice

_ROLES = ("system", "user", "assistant", "tool")


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ChatEncodingError(f"{where}: only text content parts are supported")
            parts.append(str(part.get("text") or ""))
        return "".join(parts)
    raise ChatEncodingError(f"{where}: content must be a string or a list of text parts")


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    calls = []
    for j, call in enumerate(raw or []):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ChatEncodingError(f"{where}.tool_calls[{j}] needs function.name")
        args = fn.get("arguments")
        if args is None:
            args = "{}"
        elif not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append(
            {
                "id": call.get("id") or f"call_{j}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return calls


def normalize_messages(raw: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain message dicts for an encoding. Raises :class:`ChatEncodingError`."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in _ROLES:
            raise ChatEncodingError(f"{where}.role must be one of {_ROLES}, got {role!r}")
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
        if m.get("name"):
            msg["name"] = str(m["name"])
        if role == "assistant":
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if reasoning:
                msg["reasoning_content"] = str(reasoning)
        elif role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        if msg["content"] is None and role != "assistant":
            msg["content"] = ""
        out.append(msg)
    return out


def check_tools(raw: Sequence[Mapping[str, Any]] | None) -> tuple[dict[str, Any], ...]:
    """OpenAI function tools, validated: a name each (letters, digits, ``_``, ``-``, ``.``),
    names unique, ``parameters`` a JSON-schema object when given."""
    tools: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(raw or []):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not fn:
            raise ChatEncodingError(f"tools[{i}] must be {{'type': 'function', 'function': ...}}")
        name = fn.get("name")
        if (
            not isinstance(name, str)
            or not name
            or not all(c.isalnum() or c in "_-." for c in name)
        ):
            raise ChatEncodingError(
                f"tools[{i}].function.name must be a non-empty name of letters, digits, '_', "
                f"'-' or '.', got {name!r}"
            )
        if name in seen:
            raise ChatEncodingError(f"tools[{i}]: the tool name {name!r} is given twice")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ChatEncodingError(f"tools[{i}].function.parameters must be a JSON schema object")
        tools.append(
            {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}
        )
    return tuple(tools)


def tool_names(tools: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    return tuple(str(t["function"]["name"]) for t in tools)


def parse_tool_choice(raw: Any, tools: Sequence[Mapping[str, Any]]) -> ToolChoice:
    """``"auto"`` / ``"none"`` / ``"required"`` / ``{"type": "function", "function": {"name"}}``
    (OpenAI's default: ``auto`` with tools, ``none`` without)."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise ChatEncodingError(
                f"tool_choice must be 'auto', 'none', 'required' or a named function, got {raw!r}"
            )
        if raw == "required" and not tools:
            raise ChatEncodingError("tool_choice 'required' needs tools")
        return ToolChoice(raw)
    fn = raw.get("function") if isinstance(raw, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise ChatEncodingError("a named tool_choice is {'type': 'function', 'function': {'name'}}")
    if name not in tool_names(tools):
        raise ChatEncodingError(
            f"tool_choice names the function {name!r}, which is not among the tools "
            f"{list(tool_names(tools))}"
        )
    return ToolChoice("function", name)
