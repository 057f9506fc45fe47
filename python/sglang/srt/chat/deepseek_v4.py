"""DeepSeek V4's chat encoding, written from the format the model repository publishes (its
``encoding/README.md``, the encoder's behaviour and the golden prompts in ``encoding/tests``).

The prompt is one string, tokenized whole::

    <｜begin▁of▁sentence｜>{system}[\\n\\n## Tools ...][\\n\\n## Response Format ...]
    <｜User｜>{user}<｜Assistant｜><think>            (thinking; "</think>" when it is off)
    {reasoning}</think>{content}[\\n\\n<｜DSML｜tool_calls> ...]<｜end▁of▁sentence｜>
    <｜User｜><tool_result>{result}</tool_result>...

Rules kept here: tool results are merged into the next user turn (in the order of the calls that
asked for them); in thinking mode the reasoning of turns before the last user turn is dropped
(``drop_thinking``, the default), except when the conversation declares tools, where every
turn's reasoning is passed back; ``reasoning_effort="max"`` puts the published preface first.
With ``continue_final_message`` a last assistant turn is continued (it gets no end marker).
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

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_START = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke>"
PARAM_START = f"<{DSML}parameter"
PARAM_END = f"</{DSML}parameter>"

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)

_TOOLS_PREAMBLE = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    f'by writing a "<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete "
    f"reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_CLOSING = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)
_RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools section of a system turn; ``tools`` in OpenAI format."""
    schemas = "\n".join(to_json(t["function"]) for t in tools)
    return _TOOLS_PREAMBLE + schemas + _TOOLS_CLOSING


def render_arguments(arguments: str) -> str:
    """A call's JSON arguments as DSML parameters: strings as they are, anything else as JSON.
    Arguments that are not a JSON object are passed as one string parameter ``arguments``."""
    try:
        parsed = json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        parsed = None
    if not isinstance(parsed, dict):
        parsed = {"arguments": arguments}
    lines = []
    for key, value in parsed.items():
        is_str = isinstance(value, str)
        text = value if is_str else to_json(value)
        flag = "true" if is_str else "false"
        lines.append(f'{PARAM_START} name="{key}" string="{flag}">{text}{PARAM_END}')
    return "\n".join(lines)


def render_tool_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    """``\\n\\n`` + the tool_calls block of an assistant turn (OpenAI-format calls)."""
    invokes = [
        f'{INVOKE_START} name="{c["function"]["name"]}">\n'
        f"{render_arguments(c['function']['arguments'])}\n{INVOKE_END}"
        for c in calls
    ]
    return "\n\n" + f"{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _merge_tool_results(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Tool results join the user turn that follows the calls (there is no tool role); a user
    message right after tool results (or another user message) joins the same turn."""
    merged: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role in ("tool", "user"):
            if role == "tool":
                block = {"type": "tool_result", "id": m.get("tool_call_id", "")}
            else:
                block = {"type": "text"}
            block["content"] = m.get("content") or ""
            if merged and merged[-1]["role"] == "user":
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        else:
            merged.append(dict(m))
    return _sort_tool_results(merged)


def _sort_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Within a turn, tool results follow the order of the calls of the last assistant turn
    that made calls (results whose call is unknown sort first)."""
    order: dict[str, int] = {}
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            order = {c["id"]: k for k, c in enumerate(m["tool_calls"]) if c.get("id")}
        elif m["role"] == "user" and order:
            results = [b for b in m["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1:
                it = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))
                m["blocks"] = [next(it) if b["type"] == "tool_result" else b for b in m["blocks"]]
    return messages


def _last_user(messages: Sequence[Mapping[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            return i
    return -1


class DeepseekV4Encoding(ChatEncoding):
    name = "deepseek-v4"
    default_thinking = False
    reasoning_parser = "deepseek-v4"
    tool_call_parser = "deepseek-v4"
    marker_tokens = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML)

    def render(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions) -> ChatPrompt:
        thinking = self.thinking_enabled(options)
        kwargs = options.template_kwargs
        effort = kwargs.get("reasoning_effort", options.reasoning_effort)
        msgs = [dict(m) for m in messages]
        if not msgs:
            raise ChatEncodingError("messages must not be empty")
        # Tools are declared (and a response format stated) in the system turn.
        extras: dict[str, Any] = {}
        if options.tools and options.tool_choice.mode != "none":
            extras["tools"] = options.tools
        if options.response_format is not None:
            extras["response_format"] = options.response_format
        if extras:
            if msgs[0]["role"] != "system":
                msgs.insert(0, {"role": "system", "content": ""})
            msgs[0].update(extras)
        drop = bool(kwargs.get("drop_thinking", True)) and not any(m.get("tools") for m in msgs)
        merged = _merge_tool_results(msgs)
        last_user = _last_user(merged)
        if thinking and drop:
            merged = [
                m if i >= last_user or m["role"] != "assistant" else _without_reasoning(m)
                for i, m in enumerate(merged)
            ]
        continue_last = options.continue_final_message and merged[-1]["role"] == "assistant"
        parts = [BOS]
        if thinking and effort in ("max", "xhigh"):
            parts.append(REASONING_EFFORT_MAX)
        for i, m in enumerate(merged):
            parts.append(
                self._message(
                    m, i == len(merged) - 1 and continue_last, thinking, drop, i > last_user
                )
            )
            nxt = merged[i + 1]["role"] if i + 1 < len(merged) else None
            if m["role"] == "user" and nxt in (None, "assistant"):
                open_think = thinking and (not drop or i >= last_user)
                parts.append(ASSISTANT + (THINK_START if open_think else THINK_END))
        # A continued assistant turn has closed its reasoning already (it renders "</think>").
        return ChatPrompt(
            (PromptSegment("".join(parts), special=True),), thinking and not continue_last
        )

    @staticmethod
    def _message(
        m: Mapping[str, Any], continued: bool, thinking: bool, drop: bool, after_last_user: bool
    ) -> str:
        role = m["role"]
        if role == "system":
            text = m.get("content") or ""
            if m.get("tools"):
                text += "\n\n" + render_tools(m["tools"])
            if m.get("response_format") is not None:
                text += "\n\n" + _RESPONSE_FORMAT + to_json(m["response_format"])
            return text
        if role == "user":
            blocks = [
                b["content"]
                if b["type"] == "text"
                else f"<tool_result>{b['content']}</tool_result>"
                for b in m["blocks"]
            ]
            return USER + "\n\n".join(blocks)
        if role == "assistant":
            reasoning = ""
            if thinking and (not drop or after_last_user):
                reasoning = (m.get("reasoning_content") or "") + THINK_END
            calls = render_tool_calls(m["tool_calls"]) if m.get("tool_calls") else ""
            return reasoning + (m.get("content") or "") + calls + ("" if continued else EOS)
        raise ChatEncodingError(f"DeepSeek V4 has no {role!r} turn")


def _without_reasoning(m: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if k != "reasoning_content"}
