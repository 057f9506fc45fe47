"""What the OpenAI-compatible endpoints share: the response objects' common fields, server-sent
events and the stream's ending, sampling parameters from a request body, finish and stop fields,
usage, and merging the streams of several choices."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from sglang.srt.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.managers.prompts import PromptRequests
from sglang.srt.managers.tokenizer_manager import (
    MAX_TOP_LOGPROBS,
    PreparedRequest,
    RequestError,
    TokenizerManager,
)
from sglang.srt.sampling.sampling_params import SamplingParams, SamplingParamsError
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

_OPTIONAL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "logit_bias",
)


@dataclass(frozen=True)
class ResponseHeader:
    """The fields every response object of one call starts with: a whole answer, and each chunk
    of a stream (which all carry the same id and creation time)."""

    id: str
    object: str
    created: int
    model: str

    @classmethod
    def new(cls, id_prefix: str, obj: str, model: str) -> ResponseHeader:
        return cls(f"{id_prefix}-{uuid.uuid4().hex}", obj, int(time.time()), model)

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """The response object with these ``choices`` (and ``extra`` fields after them)."""
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def event_stream(events: AsyncGenerator[str, None], what: str) -> AsyncIterator[str]:
    """``events`` as they come, then ``data: [DONE]``; a failure ends them early with an error
    event (logged unless it is the client's error). ``what`` names the stream in that log."""
    try:
        async with aclosing(events):  # a client that goes away closes the choices at once
            async for event in events:
                yield event
    except Exception as exc:
        if not isinstance(exc, RequestError):
            logger.exception("a %s stream failed", what)
        yield error_event(exc)
    yield sse("[DONE]")


def error_event(exc: BaseException) -> str:
    """The stream's last event before ``[DONE]`` when it cannot finish normally."""
    if isinstance(exc, RequestError):
        message, code = exc.message, exc.status_code
    else:
        message, code = f"internal server error: {type(exc).__name__}: {exc}", 500
    kind = (
        "ServiceUnavailableError"
        if code == 503
        else ("BadRequestError" if code < 500 else "InternalServerError")
    )
    return sse({"object": "error", "error": {"message": message, "type": kind, "code": code}})


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, max_new: int | None, name: str, min_new: int = 1
) -> SamplingParams:
    if max_new is not None and max_new < min_new:
        raise RequestError(f"{name} must be at least {min_new}, got {max_new}")
    values: dict[str, Any] = {"max_new_tokens": max_new, "n": req.n}
    for field in _OPTIONAL_SAMPLING:
        value = getattr(req, field)
        if value is not None:
            values[field] = value
    if req.stop is not None:
        values["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    if req.stop_token_ids is not None:
        values["stop_token_ids"] = req.stop_token_ids
    values["ignore_eos"] = req.ignore_eos
    values["skip_special_tokens"] = req.skip_special_tokens
    try:
        return SamplingParams.from_dict(values)
    except SamplingParamsError as exc:
        raise RequestError(str(exc).replace("max_new_tokens", name)) from None


def finish_reason(result: dict[str, Any]) -> str | None:
    reason = result["meta_info"]["finish_reason"]
    return None if reason is None else str(reason["type"])


def stop_fields(result: dict[str, Any], params: SamplingParams) -> dict[str, Any]:
    """``stop_reason`` (vLLM): the stop string or the client's stop token that ended the choice,
    else null; ``matched_stop`` (SGLang): whatever matched, EOS ids included."""
    reason = result["meta_info"]["finish_reason"]
    matched = None if reason is None or reason["type"] != "stop" else reason.get("matched")
    stop_reason = matched if isinstance(matched, str) or matched in params.stop_token_ids else None
    return {"stop_reason": stop_reason, "matched_stop": matched}


def usage(results: list[dict[str, Any]], prompt_results: list[dict[str, Any]]) -> dict[str, Any]:
    """Prompt tokens count once per prompt, not once per choice (as OpenAI bills ``n``); so do
    the prompt tokens served from the prefix cache (``prompt_tokens_details.cached_tokens``)."""
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in prompt_results)
    cached = sum(r["meta_info"].get("cached_tokens", 0) for r in prompt_results)
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def merge_streams(
    streams: list[AsyncIterator[dict[str, Any]]],
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Interleave several result streams as ``(index, result)``; cancels the rest on exit."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, None))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer, cancellation too
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def check_top(value: int, name: str) -> None:
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RequestError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")


async def prepare_all(tm: TokenizerManager, built: PromptRequests) -> list[PreparedRequest]:
    """Every request of a call, validated; each prompt is tokenized once for all its choices."""

    async def group(reqs: list[Any]) -> list[PreparedRequest]:
        first = await tm.prepare(reqs[0])  # the choices share its ids and its checked grammar
        grammar = first.request.grammar
        rest = [dataclasses.replace(r, grammar=grammar) for r in reqs[1:]]
        return [first, *(PreparedRequest(r, first.input_ids) for r in rest)]

    per_prompt = await asyncio.gather(*(group(g) for g in built.groups))
    return [p for prepared in per_prompt for p in prepared]
