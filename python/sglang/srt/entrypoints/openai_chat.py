"""``/v1/chat/completions``: messages, tools, tool choice, response format and thinking -> the
model's chat encoding -> one request per choice -> the answer read back as ``reasoning_content``,
``content`` and ``tool_calls``, whole or streamed.

Streamed deltas never carry partial markup: each choice's output goes through its own
:class:`ChatOutputParser`, which holds back any text that may still become a marker, whatever the
chunk boundaries. ``tool_choice`` ``required`` or a named function, and a JSON
``response_format``, are enforced by a grammar; with thinking on it applies to the answer only,
after the reasoning. See docs/chat_api.md.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from sglang.srt.chat.encoding import ChatEncodingError, ChatOptions, ToolChoice
from sglang.srt.chat.messages import check_tools, normalize_messages, parse_tool_choice
from sglang.srt.constrained.grammar_spec import GrammarError, GrammarSpec, check_spec
from sglang.srt.entrypoints.openai_common import (
    ResponseHeader,
    check_top,
    event_stream,
    finish_reason,
    merge_streams,
    prepare_all,
    sampling_params,
    sse,
    stop_fields,
    usage,
)
from sglang.srt.entrypoints.protocol import ChatCompletionRequest
from sglang.srt.managers.chat_format import ChatFormat
from sglang.srt.managers.generate_request import GenerateRequest
from sglang.srt.managers.prompts import build_requests
from sglang.srt.managers.tokenizer_manager import PreparedRequest, RequestError, TokenizerManager
from sglang.srt.parsers.chat_output import ChatDelta, ChatOutputParser
from sglang.srt.sampling.thinking_budget import ReasoningControl


@dataclass(frozen=True)
class ChatPlan:
    """A chat request, encoded and ready: its choices and how to read their outputs."""

    gens: list[PreparedRequest]
    fmt: ChatFormat
    thinking: bool
    tools: tuple[dict[str, Any], ...]
    choice: ToolChoice
    parallel: bool
    id_offset: int  # tool calls in the conversation so far (Kimi K3 numbers call ids on)
    separate_reasoning: bool

    def parser(self) -> ChatOutputParser:
        return self.fmt.output_parser(
            thinking=self.thinking,
            tools=self.tools,
            choice=self.choice,
            parallel=self.parallel,
            id_offset=self.id_offset,
        )


def _response_format(raw: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A JSON response format (None for text), checked."""
    if raw is None or raw.get("type") == "text":
        return None
    kind = raw.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise RequestError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param="response_format",
        )
    js = raw.get("json_schema")
    schema = js.get("schema") if isinstance(js, Mapping) else None
    if not isinstance(schema, Mapping | bool):
        raise RequestError(
            "response_format json_schema needs json_schema.schema (a JSON schema object)",
            param="response_format",
        )
    return {"type": "json_schema", "json_schema": dict(js)}  # type: ignore[arg-type]


class ChatServing:
    def __init__(self, tm: TokenizerManager) -> None:
        self.tm = tm

    @property
    def model_name(self) -> str:
        return self.tm.served_model_name

    async def _grammar(
        self,
        fmt: ChatFormat,
        rf: dict[str, Any] | None,
        tools: tuple[dict[str, Any], ...],
        choice: ToolChoice,
        parallel: bool,
        thinking: bool,
    ) -> GrammarSpec | None:
        limits = self.tm.grammar_limits
        if choice.mode in ("required", "function"):
            if rf is not None:
                raise RequestError(
                    "response_format cannot apply when tool_choice requires a tool call; "
                    "drop one of them",
                    param="response_format",
                )
            if fmt.tool_calls is None:
                raise RequestError(
                    f"tool_choice {choice.mode!r} needs a tool-call parser; start the server "
                    "with --tool-call-parser",
                    param="tool_choice",
                )
            for tool in tools:  # the limits a response_format schema has, per tool
                params = tool["function"].get("parameters")
                try:
                    check_spec(GrammarSpec("json_schema", json.dumps(params or {})), limits)
                except GrammarError as exc:
                    name = tool["function"]["name"]
                    raise RequestError(f"tool {name!r}: {exc}", param="tools") from None
            build = fmt.tool_calls.grammar
            try:
                ebnf = await self.tm.run_blocking(build, tools, choice, parallel, thinking)
            except ImportError:
                raise RequestError(
                    "structured output needs xgrammar, which is not installed"
                ) from None
            except (RuntimeError, ValueError) as exc:
                raise RequestError(
                    f"cannot build the grammar for the tools' parameters: {exc}", param="tools"
                ) from None
            return GrammarSpec("ebnf", ebnf, generated=True)
        if rf is None:
            return None
        prefix, suffix = fmt.encoding.content_affixes(thinking)
        if rf["type"] == "json_object":
            return GrammarSpec("json_object", "", prefix, suffix)
        schema = json.dumps(rf["json_schema"]["schema"])
        return GrammarSpec("json_schema", schema, prefix, suffix)

    async def _plan(self, req: ChatCompletionRequest) -> ChatPlan:
        fmt = self.tm.chat_format
        if fmt is None:
            raise RequestError(
                "chat needs a tokenizer; this server runs with --skip-tokenizer-init"
            )
        try:
            raw = [m.model_dump(exclude_none=True) for m in req.messages]
            messages = normalize_messages(raw)
            tools = check_tools(req.tools)
            choice = parse_tool_choice(req.tool_choice, tools)
        except ChatEncodingError as exc:
            raise RequestError(str(exc)) from None
        parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
        rf = _response_format(req.response_format)
        options = ChatOptions(
            tools=tools,
            tool_choice=choice,
            response_format=rf,
            reasoning_effort=req.reasoning_effort,
            template_kwargs=dict(req.chat_template_kwargs or {}),
            continue_final_message=req.continue_final_message,
        )
        prompt, ids = await self.tm.encode_chat(messages, options)
        thinking = prompt.thinking
        if req.max_completion_tokens is not None:
            max_new, name = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_new, name = req.max_tokens, "max_tokens"
        params = sampling_params(req, max_new, name)
        top = req.top_logprobs or 0
        check_top(top, "top_logprobs")
        if top and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        if req.thinking_budget is not None and req.thinking_budget < 0:
            raise RequestError("thinking_budget must be >= 0", param="thinking_budget")
        reasoning = None
        if thinking and fmt.reasoning is not None:
            end = self.tm.reasoning_end_ids(fmt.reasoning.end)
            reasoning = ReasoningControl(end, req.thinking_budget)
        id_offset = sum(len(m.get("tool_calls") or []) for m in messages)
        plan = ChatPlan(
            [], fmt, thinking, tools, choice, parallel, id_offset, req.separate_reasoning
        )
        template = GenerateRequest(
            return_logprob=req.logprobs,
            top_logprobs_num=top if req.logprobs else 0,
            stream=req.stream,
            max_tokens_param=name,
            grammar=await self._grammar(fmt, rf, tools, choice, parallel, thinking),
            reasoning=reasoning,
            keep_tokens=plan.parser().markers,
        )
        gens = await prepare_all(self.tm, build_requests(None, ids, params, template))
        return ChatPlan(
            gens, fmt, thinking, tools, choice, parallel, id_offset, req.separate_reasoning
        )

    @staticmethod
    def _chat_logprobs(result: dict[str, Any], start: int) -> dict[str, Any]:
        meta = result["meta_info"]
        entries = meta.get("output_token_logprobs", [])[start:]
        tops = meta.get("output_top_logprobs", [None] * (start + len(entries)))[start:]

        def item(lp: float, text: str | None) -> dict[str, Any]:
            t = text or ""
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

        return {
            "content": [
                {**item(lp, text), "top_logprobs": [item(l2, t2) for l2, _, t2 in (top or [])]}
                for (lp, _, text), top in zip(entries, tops)
            ]
        }

    @staticmethod
    def _finish(reason: str | None, parser: ChatOutputParser) -> str | None:
        return "tool_calls" if reason == "stop" and parser.tool_calls else reason

    # --- whole answers -------------------------------------------------------------------------

    def _message(self, plan: ChatPlan, parser: ChatOutputParser) -> dict[str, Any]:
        reasoning, content = parser.reasoning_text, parser.content_text
        if not plan.separate_reasoning:
            reasoning, content = "", reasoning + content
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not parser.tool_calls else None,
            "reasoning_content": reasoning or None,
        }
        if parser.tool_calls:
            message["tool_calls"] = parser.tool_calls
        if parser.invalid_tool_calls:
            message["invalid_tool_calls"] = parser.invalid_tool_calls
        return message

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any]:
        plan = await self._plan(req)
        results = await asyncio.gather(*(self.tm.generate_one(g) for g in plan.gens))
        choices = []
        for i, (g, r) in enumerate(zip(plan.gens, results)):
            parser = plan.parser()
            parser.finish(r["text"])
            choices.append(
                {
                    "index": i,
                    "message": self._message(plan, parser),
                    "logprobs": self._chat_logprobs(r, 0) if g.request.return_logprob else None,
                    "finish_reason": self._finish(finish_reason(r), parser),
                    **stop_fields(r, g.request.sampling_params),
                }
            )
        head = ResponseHeader.new("chatcmpl", "chat.completion", self.model_name)
        return head.body(choices, usage=usage(list(results), list(results)[:1]))

    # --- streams -------------------------------------------------------------------------------

    async def chat_stream(self, req: ChatCompletionRequest) -> AsyncIterator[str]:
        plan = await self._plan(req)  # raises before the response starts
        return event_stream(self._events(req, plan), "chat")

    @staticmethod
    def _delta(d: ChatDelta, separate: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        reasoning, content = d.reasoning, d.content
        if not separate:
            reasoning, content = "", reasoning + content
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if d.tool_calls:
            out["tool_calls"] = d.tool_calls
        return out

    async def _events(
        self, req: ChatCompletionRequest, plan: ChatPlan
    ) -> AsyncGenerator[str, None]:
        head = ResponseHeader.new("chatcmpl", "chat.completion.chunk", self.model_name)
        gens = plan.gens

        def chunk(
            index: int,
            delta: dict[str, Any],
            reason: str | None,
            logprobs: Any = None,
            extra: dict[str, Any] | None = None,
        ) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return sse(head.body([{**choice, **(extra or {})}]))

        for i in range(len(gens)):
            yield chunk(i, {"role": "assistant", "content": ""}, None)
        parsers = [plan.parser() for _ in gens]
        sent_text = [0] * len(gens)
        sent_tokens = [0] * len(gens)
        last: dict[int, dict[str, Any]] = {}
        async for i, r in merge_streams([self.tm.generate(g) for g in gens]):
            last[i] = r
            text = r["text"][sent_text[i] :]
            reason = finish_reason(r)
            n_tokens = len(r["output_ids"])
            if not text and reason is None and n_tokens == sent_tokens[i]:
                continue
            parser = parsers[i]
            d = parser.feed(text) if reason is None else parser.finish(text)
            delta = self._delta(d, plan.separate_reasoning)
            g = gens[i]
            lp = self._chat_logprobs(r, sent_tokens[i]) if g.request.return_logprob else None
            extra = None
            if reason is not None:
                extra = stop_fields(r, g.request.sampling_params)
                if parser.invalid_tool_calls:
                    delta["invalid_tool_calls"] = parser.invalid_tool_calls
            sent_text[i], sent_tokens[i] = len(r["text"]), n_tokens
            if not delta and reason is None and lp is None:
                continue  # everything new is held back for now
            yield chunk(i, delta, self._finish(reason, parser), lp, extra)
        if last and req.stream_options is not None and req.stream_options.include_usage:
            results = [last[i] for i in sorted(last)]
            yield sse(head.body([], usage=usage(results, results[:1])))
