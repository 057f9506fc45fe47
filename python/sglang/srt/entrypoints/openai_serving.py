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
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from sglang.srt.entrypoints.openai_chat import ChatServing
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
from sglang.srt.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.managers.detokenizer import TokenOffsets
from sglang.srt.managers.generate_request import GenerateRequest
from sglang.srt.managers.prompts import build_requests
from sglang.srt.managers.tokenizer_manager import PreparedRequest, RequestError, TokenizerManager


class OpenAIServing:
    def __init__(self, tm: TokenizerManager) -> None:
        self.tm = tm
        self.chat_serving = ChatServing(tm)

    @property
    def model_name(self) -> str:
        return self.tm.served_model_name

    # --- completions ---------------------------------------------------------------------------

    async def _completion_prompts(self, req: CompletionRequest) -> list[PreparedRequest]:
        p = req.prompt
        if isinstance(p, list) and not p:
            raise RequestError("prompt is empty")
        # max_tokens 0 with echo scores the prompt only (its log-probs), as in vLLM.
        params = sampling_params(req, req.max_tokens, "max_tokens", 0 if req.echo else 1)
        if req.logprobs is not None:
            check_top(req.logprobs, "logprobs")
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
        return await prepare_all(self.tm, built)

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
                    "finish_reason": finish_reason(r),
                    **stop_fields(r, g.request.sampling_params),
                }
            )
        head = ResponseHeader.new("cmpl", "text_completion", self.model_name)
        return head.body(choices, usage=usage(list(results), list(results)[:: max(1, req.n)]))

    async def completions_stream(self, req: CompletionRequest) -> AsyncIterator[str]:
        gens = await self._completion_prompts(req)  # raises before the response starts
        return event_stream(self._completions_events(req, gens), "completions")

    async def _completions_events(
        self, req: CompletionRequest, gens: list[PreparedRequest]
    ) -> AsyncGenerator[str, None]:
        head = ResponseHeader.new("cmpl", "text_completion", self.model_name)
        sent_text = [0] * len(gens)
        sent_tokens = [0] * len(gens)
        started = [False] * len(gens)
        offsets: list[TokenOffsets | None] = [None] * len(gens)
        last: dict[int, dict[str, Any]] = {}
        async for i, r in merge_streams([self.tm.generate(g) for g in gens]):
            last[i] = r
            text = r["text"]
            delta = text[sent_text[i] :]
            reason = finish_reason(r)
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
            choice = {"index": i, "text": prefix + delta, "logprobs": lp, "finish_reason": reason}
            if reason is not None:
                choice.update(stop_fields(r, gens[i].request.sampling_params))
            yield sse(head.body([choice]))
            started[i] = True
            sent_text[i], sent_tokens[i] = len(text), n_tokens
        if req.stream_options is not None and req.stream_options.include_usage:
            results = [last[i] for i in sorted(last)]
            yield sse(head.body([], usage=usage(results, results[:: max(1, req.n)])))

    # --- chat ----------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any]:
        return await self.chat_serving.chat(req)

    async def chat_stream(self, req: ChatCompletionRequest) -> AsyncIterator[str]:
        return await self.chat_serving.chat_stream(req)
