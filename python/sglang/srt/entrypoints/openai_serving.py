"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` on top of the tokenizer
manager: request -> one :class:`GenerateRequest` per prompt and choice (``n``) -> OpenAI response
objects, whole or as server-sent events (``data: {...}`` chunks, then ``data: [DONE]``).

Beyond the basics, as SGLang and vLLM users expect: ``n > 1`` (choice ``i`` of prompt ``p`` is
index ``p * n + i``), ``logit_bias``, ``echo`` with the prompt's log-probs, and ``stop_reason`` (the
stop string or stop token id that ended a choice; ``null`` for EOS or length) next to SGLang's
``matched_stop``. A failure mid-stream ends the stream with an error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from sglang.srt.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.managers.detokenizer import TokenOffsets
from sglang.srt.managers.generate_request import GenerateRequest
from sglang.srt.managers.prompts import PromptRequests, build_requests
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


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


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


def _sampling_params(
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


def _finish_reason(result: dict[str, Any]) -> str | None:
    reason = result["meta_info"]["finish_reason"]
    return None if reason is None else str(reason["type"])


def _stop_fields(result: dict[str, Any], params: SamplingParams) -> dict[str, Any]:
    """``stop_reason`` (vLLM): the stop string or the client's stop token that ended the choice,
    else null; ``matched_stop`` (SGLang): whatever matched, EOS ids included."""
    reason = result["meta_info"]["finish_reason"]
    matched = None if reason is None or reason["type"] != "stop" else reason.get("matched")
    stop_reason = matched if isinstance(matched, str) or matched in params.stop_token_ids else None
    return {"stop_reason": stop_reason, "matched_stop": matched}


def _usage(results: list[dict[str, Any]], prompt_results: list[dict[str, Any]]) -> dict[str, int]:
    """Prompt tokens count once per prompt, not once per choice (as OpenAI bills ``n``)."""
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in prompt_results)
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


def _check_top(value: int, name: str) -> None:
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RequestError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")


class OpenAIServing:
    def __init__(self, tm: TokenizerManager) -> None:
        self.tm = tm

    @property
    def model_name(self) -> str:
        return self.tm.served_model_name

    async def _prepare_group(self, group: list[GenerateRequest]) -> list[PreparedRequest]:
        """One prompt's choices: tokenized once, one prepared request per choice."""
        prepared = await self.tm.prepare(group[0])
        return [PreparedRequest(r, prepared.input_ids) for r in group]

    async def _prepare_all(self, built: PromptRequests) -> list[PreparedRequest]:
        per_prompt = await asyncio.gather(*(self._prepare_group(g) for g in built.groups))
        return [p for group in per_prompt for p in group]

    # --- completions ---------------------------------------------------------------------------

    async def _completion_prompts(self, req: CompletionRequest) -> list[PreparedRequest]:
        p = req.prompt
        if isinstance(p, list) and not p:
            raise RequestError("prompt is empty")
        # max_tokens 0 with echo scores the prompt only (its log-probs), as in vLLM.
        params = _sampling_params(req, req.max_tokens, "max_tokens", 0 if req.echo else 1)
        if req.logprobs is not None:
            _check_top(req.logprobs, "logprobs")
        want_lp = req.logprobs is not None
        template = GenerateRequest(
            return_logprob=want_lp,
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if want_lp and req.echo else -1,
            stream=req.stream,
            max_tokens_param="max_tokens",
        )
        # OpenAI's one field holds text, token ids, or a list of either.
        if isinstance(p, str) or all(isinstance(x, str) for x in p):
            built = build_requests(p, None, params, template, text_name="prompt")  # type: ignore[arg-type]
        else:
            built = build_requests(None, p, params, template, text_name="prompt")  # type: ignore[arg-type]
        return await self._prepare_all(built)

    def _prompt_text(self, g: PreparedRequest) -> tuple[str, bool]:
        """The prompt as ``echo`` returns it, and whether its decode skips special tokens (a
        text prompt comes back as sent, which has no BOS; token ids are decoded whole)."""
        if g.request.text is not None:
            return g.request.text, True
        tok = self.tm.tokenizer
        text = "" if tok is None else tok.decode(g.input_ids, skip_special_tokens=False)
        return text, False

    def _offsets(self, skip_special_tokens: bool, start: int) -> TokenOffsets | None:
        tok = self.tm.tokenizer
        return (
            None
            if tok is None
            else TokenOffsets(tok, skip_special_tokens=skip_special_tokens, start=start)
        )

    @staticmethod
    def _logprob_block(
        entries: list[Any], tops: list[Any] | None, offsets: TokenOffsets | None
    ) -> dict[str, list[Any]]:
        tokens = [text or "" for _, _, text in entries]  # each entry carries its token's text
        ids = [tid for _, tid, _ in entries]
        tops = tops if tops is not None else [None] * len(entries)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _, _ in entries],
            "top_logprobs": [
                None if top is None else {(text or ""): lp for lp, _, text in top} for top in tops
            ],
            "text_offset": [0] * len(ids) if offsets is None else offsets.add(ids),
        }

    def _completion_logprobs(
        self,
        result: dict[str, Any],
        start: int,
        offsets: TokenOffsets | None,
        echo: tuple[str, bool] | None = None,
    ) -> dict[str, Any]:
        """Log-probs of the output tokens from ``start`` on; with ``echo`` (the prompt text and
        its skip flag), the prompt's tokens first (the first has no log-prob). Every
        ``text_offset`` indexes into the choice's text (prompt text + output text)."""
        meta = result["meta_info"]
        entries = meta.get("output_token_logprobs", [])[start:]
        tops = meta.get("output_top_logprobs")
        out = self._logprob_block(entries, None if tops is None else tops[start:], offsets)
        if echo is not None:
            prompt_text, skip = echo
            prompt = self._logprob_block(
                meta.get("input_token_logprobs", []),
                meta.get("input_top_logprobs"),
                self._offsets(skip, 0),
            )
            # A text prompt's decode can differ from the text sent (normalization): stay inside.
            prompt["text_offset"] = [min(o, len(prompt_text)) for o in prompt["text_offset"]]
            for key in out:
                out[key] = prompt[key] + out[key]
        return out

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        gens = await self._completion_prompts(req)
        results = await asyncio.gather(*(self.tm.generate_one(g) for g in gens))
        choices = []
        for i, (g, r) in enumerate(zip(gens, results)):
            text = r["text"]
            echo = self._prompt_text(g) if req.echo else None
            prefix = "" if echo is None else echo[0]
            lp = None
            if g.request.return_logprob:
                skip = g.request.sampling_params.skip_special_tokens
                lp = self._completion_logprobs(r, 0, self._offsets(skip, len(prefix)), echo)
                # A stop string cuts the text; the tokens past the cut point at its end.
                end = len(prefix) + len(text)
                lp["text_offset"] = [min(o, end) for o in lp["text_offset"]]
            choices.append(
                {
                    "index": i,
                    "text": prefix + text,
                    "logprobs": lp,
                    "finish_reason": _finish_reason(r),
                    **_stop_fields(r, g.request.sampling_params),
                }
            )
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(list(results), list(results)[:: max(1, req.n)]),
        }

    async def completions_stream(self, req: CompletionRequest) -> AsyncIterator[str]:
        gens = await self._completion_prompts(req)  # raises before the response starts
        return self._completions_events(req, gens)

    async def _completions_events(
        self, req: CompletionRequest, gens: list[PreparedRequest]
    ) -> AsyncIterator[str]:
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        sent_text = [0] * len(gens)
        sent_tokens = [0] * len(gens)
        started = [False] * len(gens)
        offsets: list[TokenOffsets | None] = [None] * len(gens)
        last: dict[int, dict[str, Any]] = {}
        try:
            async for i, r in _merge([self.tm.generate(g) for g in gens]):
                last[i] = r
                text = r["text"]
                delta = text[sent_text[i] :]
                reason = _finish_reason(r)
                n_tokens = len(r["output_ids"])
                echo_now = req.echo and not started[i]
                if not delta and reason is None and n_tokens == sent_tokens[i] and not echo_now:
                    continue
                echo = self._prompt_text(gens[i]) if echo_now else None
                prefix = "" if echo is None else echo[0]
                lp = None
                if gens[i].request.return_logprob:
                    if offsets[i] is None:  # output offsets follow the echoed prompt
                        skip = gens[i].request.sampling_params.skip_special_tokens
                        offsets[i] = self._offsets(skip, len(prefix))
                    lp = self._completion_logprobs(r, sent_tokens[i], offsets[i], echo)
                chunk = self._completion_chunk(cid, created, i, prefix + delta, lp, reason)
                if reason is not None:
                    chunk["choices"][0].update(_stop_fields(r, gens[i].request.sampling_params))
                yield sse(chunk)
                started[i] = True
                sent_text[i], sent_tokens[i] = len(text), n_tokens
            if req.stream_options is not None and req.stream_options.include_usage:
                results = [last[i] for i in sorted(last)]
                yield sse(
                    {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": _usage(results, results[:: max(1, req.n)]),
                    }
                )
        except Exception as exc:
            if not isinstance(exc, RequestError):
                logger.exception("a completions stream failed")
            yield error_event(exc)
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

    async def _chat_request(self, req: ChatCompletionRequest) -> list[PreparedRequest]:
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            messages.append({"role": m.role, "content": content or ""})
        ids = await self.tm.encode_chat(messages)
        if req.max_completion_tokens is not None:
            max_new, name = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_new, name = req.max_tokens, "max_tokens"
        params = _sampling_params(req, max_new, name)
        top = req.top_logprobs or 0
        _check_top(top, "top_logprobs")
        if top and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        template = GenerateRequest(
            return_logprob=req.logprobs,
            top_logprobs_num=top if req.logprobs else 0,
            stream=req.stream,
            max_tokens_param=name,
        )
        return await self._prepare_all(build_requests(None, ids, params, template))

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
        gens = await self._chat_request(req)
        results = await asyncio.gather(*(self.tm.generate_one(g) for g in gens))
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": r["text"]},
                    "logprobs": self._chat_logprobs(r, 0) if g.request.return_logprob else None,
                    "finish_reason": _finish_reason(r),
                    **_stop_fields(r, g.request.sampling_params),
                }
                for i, (g, r) in enumerate(zip(gens, results))
            ],
            "usage": _usage(list(results), list(results)[:1]),
        }

    async def chat_stream(self, req: ChatCompletionRequest) -> AsyncIterator[str]:
        gens = await self._chat_request(req)  # raises before the response starts
        return self._chat_events(req, gens)

    async def _chat_events(
        self, req: ChatCompletionRequest, gens: list[PreparedRequest]
    ) -> AsyncIterator[str]:
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(
            index: int,
            delta: dict[str, Any],
            reason: str | None,
            logprobs: Any = None,
            extra: dict[str, Any] | None = None,
        ) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return sse(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": self.model_name,
                    "choices": [{**choice, **(extra or {})}],
                }
            )

        for i in range(len(gens)):
            yield chunk(i, {"role": "assistant", "content": ""}, None)
        sent_text = [0] * len(gens)
        sent_tokens = [0] * len(gens)
        last: dict[int, dict[str, Any]] = {}
        try:
            async for i, r in _merge([self.tm.generate(g) for g in gens]):
                last[i] = r
                delta = r["text"][sent_text[i] :]
                reason = _finish_reason(r)
                n_tokens = len(r["output_ids"])
                if not delta and reason is None and n_tokens == sent_tokens[i]:
                    continue
                g = gens[i]
                lp = self._chat_logprobs(r, sent_tokens[i]) if g.request.return_logprob else None
                extra = None if reason is None else _stop_fields(r, g.request.sampling_params)
                yield chunk(i, {"content": delta} if delta else {}, reason, lp, extra)
                sent_text[i], sent_tokens[i] = len(r["text"]), n_tokens
            if last and req.stream_options is not None and req.stream_options.include_usage:
                results = [last[i] for i in sorted(last)]
                yield sse(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": _usage(results, results[:1]),
                    }
                )
        except Exception as exc:
            if not isinstance(exc, RequestError):
                logger.exception("a chat stream failed")
            yield error_event(exc)
        yield sse("[DONE]")
