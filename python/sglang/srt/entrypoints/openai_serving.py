"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` on top of the tokenizer
manager: request -> one :class:`GenerateRequest` per prompt -> OpenAI response objects, whole or
as server-sent events (``data: {...}`` chunks, then ``data: [DONE]``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from sglang.srt.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.managers.tokenizer_manager import (
    GenerateRequest,
    PreparedRequest,
    RequestError,
    TokenizerManager,
)
from sglang.srt.sampling.sampling_params import SamplingParams, SamplingParamsError

_OPTIONAL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
)


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest, max_new: int | None
) -> SamplingParams:
    if max_new is not None and max_new < 1:
        raise RequestError(f"max_tokens must be at least 1, got {max_new}")
    values: dict[str, Any] = {"max_new_tokens": max_new, "n": req.n}
    for name in _OPTIONAL_SAMPLING:
        value = getattr(req, name)
        if value is not None:
            values[name] = value
    if req.stop is not None:
        values["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    if req.stop_token_ids is not None:
        values["stop_token_ids"] = req.stop_token_ids
    values["ignore_eos"] = req.ignore_eos
    values["skip_special_tokens"] = req.skip_special_tokens
    try:
        return SamplingParams.from_dict(values)
    except SamplingParamsError as exc:
        raise RequestError(str(exc).replace("max_new_tokens", "max_tokens")) from None


def _finish_reason(result: dict[str, Any]) -> str | None:
    reason = result["meta_info"]["finish_reason"]
    return None if reason is None else str(reason["type"])


def _usage(results: list[dict[str, Any]]) -> dict[str, int]:
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in results)
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _merge(
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


class OpenAIServing:
    def __init__(self, tm: TokenizerManager) -> None:
        self.tm = tm

    @property
    def model_name(self) -> str:
        return self.tm.served_model_name

    # --- completions ---------------------------------------------------------------------------

    def _completion_prompts(self, req: CompletionRequest) -> list[PreparedRequest]:
        p = req.prompt
        if isinstance(p, str):
            prompts: list[tuple[str | None, list[int] | None]] = [(p, None)]
        elif not p:
            raise RequestError("prompt is empty")
        elif all(isinstance(x, int) for x in p):
            prompts = [(None, list(p))]  # type: ignore[arg-type]
        elif all(isinstance(x, str) for x in p):
            prompts = [(x, None) for x in p]  # type: ignore[misc]
        else:
            prompts = [(None, list(x)) for x in p]  # type: ignore[arg-type]
        params = _sampling_params(req, req.max_tokens)
        if req.logprobs is not None and req.logprobs < 0:
            raise RequestError("logprobs must be >= 0")
        want_lp = req.logprobs is not None
        return [
            self.tm.prepare(
                GenerateRequest(
                    text=text,
                    input_ids=ids,
                    sampling_params=params,
                    return_logprob=want_lp,
                    top_logprobs_num=req.logprobs or 0,
                    stream=req.stream,
                )
            )
            for text, ids in prompts
        ]

    def _completion_logprobs(
        self, result: dict[str, Any], start: int, offset0: int
    ) -> dict[str, Any]:
        meta = result["meta_info"]
        entries = meta.get("output_token_logprobs", [])[start:]
        tops = meta.get("output_top_logprobs", [None] * (start + len(entries)))[start:]
        tokens = [text or "" for _, _, text in entries]  # each entry carries its token's text
        offsets, pos = [], offset0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _, _ in entries],
            "top_logprobs": [
                None if top is None else {(text or ""): lp for lp, _, text in top}
                for top in tops
            ],
            "text_offset": offsets,
        }

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        gens = self._completion_prompts(req)
        results = await asyncio.gather(*(self.tm.generate_one(g) for g in gens))
        choices = []
        for i, (g, r) in enumerate(zip((p.request for p in gens), results)):
            text = r["text"]
            if req.echo and g.text is not None:
                text = g.text + text
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": self._completion_logprobs(r, 0, 0) if g.return_logprob else None,
                    "finish_reason": _finish_reason(r),
                }
            )
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(list(results)),
        }

    async def completions_stream(self, req: CompletionRequest) -> AsyncIterator[str]:
        gens = self._completion_prompts(req)  # raises before the response starts
        return self._completions_events(req, gens)

    async def _completions_events(
        self, req: CompletionRequest, gens: list[PreparedRequest]
    ) -> AsyncIterator[str]:
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        sent_text = [0] * len(gens)
        sent_tokens = [0] * len(gens)
        last: dict[int, dict[str, Any]] = {}
        try:
            async for i, r in _merge([self.tm.generate(g) for g in gens]):
                last[i] = r
                text = r["text"]
                prompt_text = gens[i].request.text
                if req.echo and sent_text[i] == 0 and sent_tokens[i] == 0 and prompt_text:
                    yield sse(self._completion_chunk(cid, created, i, prompt_text, None, None))
                delta = text[sent_text[i] :]
                reason = _finish_reason(r)
                n_tokens = len(r["output_ids"])
                if not delta and reason is None and n_tokens == sent_tokens[i]:
                    continue
                lp = (
                    self._completion_logprobs(r, sent_tokens[i], sent_text[i])
                    if gens[i].request.return_logprob
                    else None
                )
                yield sse(self._completion_chunk(cid, created, i, delta, lp, reason))
                sent_text[i], sent_tokens[i] = len(text), n_tokens
            if req.stream_options is not None and req.stream_options.include_usage:
                yield sse(
                    {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": _usage(list(last.values())),
                    }
                )
        except RequestError as exc:
            yield sse({"error": {"message": exc.message, "code": exc.status_code}})
        yield sse("[DONE]")

    def _completion_chunk(
        self, cid: str, created: int, index: int, text: str, logprobs: Any, reason: str | None
    ) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
            ],
        }

    # --- chat ----------------------------------------------------------------------------------

    def _chat_request(self, req: ChatCompletionRequest) -> PreparedRequest:
        if self.tm.tokenizer is None:
            raise RequestError(
                "chat needs a tokenizer; this server runs with --skip-tokenizer-init"
            )
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            messages.append({"role": m.role, "content": content or ""})
        try:
            prompt = self.tm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - template errors (raise_exception) are the client's
            raise RequestError(f"cannot apply the chat template: {exc}") from None
        ids = self.tm.tokenizer.encode(prompt, add_special_tokens=False)
        max_new = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        params = _sampling_params(req, max_new)
        top = req.top_logprobs or 0
        if top < 0:
            raise RequestError("top_logprobs must be >= 0")
        return self.tm.prepare(
            GenerateRequest(
                input_ids=ids,
                sampling_params=params,
                return_logprob=req.logprobs,
                top_logprobs_num=top if req.logprobs else 0,
                stream=req.stream,
            )
        )

    def _chat_logprobs(self, result: dict[str, Any], start: int) -> dict[str, Any]:
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

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any]:
        g = self._chat_request(req)
        r = await self.tm.generate_one(g)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": r["text"]},
                    "logprobs": self._chat_logprobs(r, 0) if g.request.return_logprob else None,
                    "finish_reason": _finish_reason(r),
                }
            ],
            "usage": _usage([r]),
        }

    async def chat_stream(self, req: ChatCompletionRequest) -> AsyncIterator[str]:
        g = self._chat_request(req)  # raises before the response starts
        return self._chat_events(req, g)

    async def _chat_events(
        self, req: ChatCompletionRequest, g: PreparedRequest
    ) -> AsyncIterator[str]:
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict[str, Any], reason: str | None, logprobs: Any = None) -> str:
            return sse(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": self.model_name,
                    "choices": [
                        {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
                    ],
                }
            )

        yield chunk({"role": "assistant", "content": ""}, None)
        sent_text = sent_tokens = 0
        last: dict[str, Any] | None = None
        try:
            async for r in self.tm.generate(g):
                last = r
                delta = r["text"][sent_text:]
                reason = _finish_reason(r)
                n_tokens = len(r["output_ids"])
                if not delta and reason is None and n_tokens == sent_tokens:
                    continue
                lp = self._chat_logprobs(r, sent_tokens) if g.request.return_logprob else None
                yield chunk({"content": delta} if delta else {}, reason, lp)
                sent_text, sent_tokens = len(r["text"]), n_tokens
            if (
                last is not None
                and req.stream_options is not None
                and req.stream_options.include_usage
            ):
                yield sse(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": _usage([last]),
                    }
                )
        except RequestError as exc:
            yield sse({"error": {"message": exc.message, "code": exc.status_code}})
        yield sse("[DONE]")
