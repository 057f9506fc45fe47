"""The tokenizer manager (main process): validates and tokenizes requests, sends them to
scheduler rank 0, and turns its token outputs back into text results, streamed or whole.

Threads: a sender thread writes to the scheduler pipe (a large prompt never blocks the event
loop); a receiver thread reads outputs and hands them to the event loop, where all request state
lives; tokenization and chat templating run in a small thread pool (the tokenizer releases the GIL),
so one large prompt cannot stall other streams or /health; a watchdog thread notices a scheduler
rank that exits and fails every pending request (the owner then stops the server). A request whose
consumer goes away before it finishes (client disconnect, cancelled task) is aborted, which frees
its cache on every rank.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import signal
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from sglang.srt.chat.encoding import ChatEncodingError, ChatOptions, ChatPrompt
from sglang.srt.constrained.grammar_compiler import timeout_message
from sglang.srt.constrained.grammar_spec import GrammarError, GrammarSpec, build_grammar
from sglang.srt.managers.chat_format import ChatFormat
from sglang.srt.managers.detokenizer import IncrementalDetokenizer
from sglang.srt.managers.generate_request import (  # noqa: F401 - re-exported for callers
    MAX_CHOICES,
    GenerateRequest,
    check_choices,
    expand_n,
)
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchOutput,
    FinishReason,
    FlushCacheReq,
    FlushCacheResult,
    ReqError,
    ReqOutput,
    SchedulerFailed,
    SchedulerStats,
    StatsReq,
    TokenizedGenerateReq,
)
from sglang.srt.managers.launcher import SchedulerHandle
from sglang.srt.managers.metrics import ServerMetrics
from sglang.srt.managers.output_constraints import grammar_backend_in_use, grammar_limits
from sglang.srt.managers.prompts import check_one_kind
from sglang.srt.managers.request_error import RequestError
from sglang.srt.managers.tokenizer import TextTokenizer, load_tokenizer
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

T = TypeVar("T")
MAX_TOP_LOGPROBS = 20
# A token is never more than this many times its longest vocabulary entry in characters
# (normalizers such as NFKC can shorten text), so a text longer than
# context_length * longest_token * this cannot fit and is rejected without tokenizing it.
_CHARS_PER_TOKEN_SLACK = 4
_WATCHDOG_POLL_S = 0.2
_CHECKED_GRAMMARS = 512  # grammar checks remembered (by spec)


def check_text(text: str, what: str) -> None:
    """Reject text that is not valid Unicode (a lone surrogate such as "\\ud800", which JSON
    escapes can carry): the tokenizer cannot take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.start + 1]
        raise RequestError(
            f"{what} is not valid Unicode: lone surrogate {bad!a} at character {exc.start}"
        ) from None


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request (see :meth:`TokenizerManager.prepare`)."""

    request: GenerateRequest
    input_ids: list[int]


@dataclass
class _ReqState:
    rid: str
    prompt_ids: list[int]
    request: GenerateRequest
    detok: IncrementalDetokenizer | None
    created: float
    event: asyncio.Event = field(default_factory=asyncio.Event)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    finish: FinishReason | None = None
    error: RequestError | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    cached_tokens: int = 0  # prompt tokens the scheduler resumed from the prefix cache


def load_server_tokenizer(args: ServerArgs) -> TextTokenizer | None:
    """The tokenizer the options ask for (``None`` with --skip-tokenizer-init). Load it before
    starting the schedulers: a missing tokenizer should fail in milliseconds, not after the
    model loads. Raises :class:`TokenizerLoadError`."""
    if args.skip_tokenizer_init:
        return None
    assert args.model_path is not None
    return load_tokenizer(args.tokenizer_path or args.model_path)


class TokenizerManager:
    def __init__(
        self,
        args: ServerArgs,
        handle: SchedulerHandle,
        tokenizer: TextTokenizer | None | Literal["load"] = "load",
    ) -> None:
        self.args = args
        self.handle = handle
        self.info = handle.model_info
        self.served_model_name = args.served_model_name or args.model_path or "default"
        self.tokenizer = load_server_tokenizer(args) if tokenizer == "load" else tokenizer
        self.metrics = ServerMetrics(self.served_model_name) if args.enable_metrics else None
        self.states: dict[str, _ReqState] = {}
        # Replies rank 0 owes (stats, cache flushes), by the id their request carried.
        self._reply_waiters: dict[int, asyncio.Future[Any]] = {}
        self._reply_ids = itertools.count()
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.scheduler_alive = True
        self.draining = False  # shutting down: no new requests
        self.fatal_error: str | None = None  # why a scheduler rank died
        self.peer_failure: str | None = None  # rank 0's word on a rank it lost (maybe remote)
        # Called once (on the event loop) when a rank dies; the HTTP server stops itself.
        self.on_fatal: Callable[[str], None] | None = None
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sglang-tokenize")
        # Beyond this many characters a text prompt cannot fit the context (see the constant).
        self.max_prompt_chars: int | None = None
        if self.tokenizer is not None:
            longest = max(1, self.tokenizer.longest_token_chars)
            self.max_prompt_chars = self.info.context_length * longest * _CHARS_PER_TOKEN_SLACK
        # Chat: the encoding and its parsers; structured output: what grammars may run.
        self.chat_format = (
            None if self.tokenizer is None else ChatFormat.resolve(args, self.tokenizer)
        )
        self.grammar_backend = grammar_backend_in_use(args.grammar_backend)
        self.grammar_limits = grammar_limits()
        self._checked_grammars: OrderedDict[tuple[str, ...], str | None] = OrderedDict()
        self._skip_ids: dict[tuple[str, ...], frozenset[int]] = {}
        self._end_ids: dict[str, tuple[int, ...]] = {}

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the event loop that will run requests; start the pipe threads."""
        if self._loop is not None:
            return
        self._loop = loop
        for target, name in (
            (self._send_loop, "sender"),
            (self._recv_loop, "receiver"),
            (self._watch_ranks, "watchdog"),
        ):
            t = threading.Thread(target=target, name=f"sglang-tokenizer-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        """Stop sending (the owner shuts the schedulers down next)."""
        self._closing = True
        self._outbox.put(None)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def begin_drain(self) -> None:
        """Shutting down: refuse new requests (503); running ones go on."""
        self.draining = True

    def fail_all(self, message: str, status_code: int = 503) -> int:
        """End every pending request with an error (streams send it as an error event).
        Event-loop thread. Returns how many were ended."""
        n = 0
        for state in self.states.values():
            if state.finish is None and state.error is None:
                state.error = RequestError(message, status_code)
                state.event.set()
                n += 1
        for waiter in self._reply_waiters.values():
            if not waiter.done():
                waiter.set_exception(RequestError(message, status_code))
        return n

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work (tokenizing, templating) off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    def _send(self, msg: Any) -> None:
        self._outbox.put(msg)

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self.handle.to_scheduler.send(msg)
            except (OSError, ValueError):
                return

    def _recv_loop(self) -> None:
        assert self._loop is not None
        while True:
            try:
                msg = self.handle.from_scheduler.recv()
            except (EOFError, OSError):
                break
            try:
                self._loop.call_soon_threadsafe(self._dispatch, msg)
            except RuntimeError:  # loop closed
                return
        if not self._closing:  # the pipe closes a moment before the exit can be read
            deadline = time.monotonic() + 2.0
            procs = self.handle.procs
            while time.monotonic() < deadline and all(p.exitcode is None for p in procs):
                time.sleep(0.02)
        try:
            self._loop.call_soon_threadsafe(self._scheduler_gone, self._dead_ranks_reason())
        except RuntimeError:
            pass

    def _dead_ranks_reason(self) -> str:
        """Which ranks exited and how, e.g. ``scheduler rank 1 (pid 42) was killed by SIGKILL``."""
        parts = []
        for rank, p in enumerate(self.handle.procs):
            code = p.exitcode
            if code is None:
                continue
            if code < 0:
                try:
                    how = f"was killed by {signal.Signals(-code).name}"
                except ValueError:
                    how = f"was killed by signal {-code}"
            else:
                how = f"exited with code {code}"
            parts.append(f"scheduler rank {rank} (pid {p.pid}) {how}")
        if self.peer_failure is not None:
            parts.append(self.peer_failure)
        return "; ".join(parts) or "the scheduler closed its pipe"

    def _watch_ranks(self) -> None:
        """A rank that exits (crash, OOM kill, SIGKILL) is noticed within a poll, whichever it is:
        rank 0 closing its pipe is seen by the receiver too, a follower only here."""
        assert self._loop is not None
        while not self._closing and self.scheduler_alive:
            if any(p.exitcode is not None for p in self.handle.procs):
                time.sleep(_WATCHDOG_POLL_S)  # let its siblings' exits show in the reason
                try:
                    self._loop.call_soon_threadsafe(self._scheduler_gone, self._dead_ranks_reason())
                except RuntimeError:
                    pass
                return
            time.sleep(_WATCHDOG_POLL_S)

    # --- outputs (event-loop thread) -----------------------------------------------------------

    def _scheduler_gone(self, reason: str = "the scheduler process exited") -> None:
        if not self.scheduler_alive:
            return
        self.scheduler_alive = False
        if self._closing or getattr(self.handle, "stopped", False):  # an ordered stop
            self.fail_all("the server is shutting down", 503)
            return
        self.fatal_error = reason
        logger.error(
            f"{reason}; the engine cannot serve without every rank: failing all pending "
            "requests and stopping"
        )
        self.fail_all(f"the engine failed: {reason}", 500)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchOutput):
            for out in msg.outputs:
                try:
                    self._on_output(out)
                except Exception as exc:  # e.g. a detokenizer error: fail that request alone
                    logger.exception(f"failed to process the output of request {out.rid}")
                    state = self.states.get(out.rid)
                    if state is not None and state.finish is None and state.error is None:
                        state.error = RequestError(f"internal error: {exc!r}", 500)
                        state.event.set()
        elif isinstance(msg, ReqError):
            state = self.states.get(msg.rid)
            if state is not None and state.finish is None:
                state.error = RequestError(msg.message, msg.status_code)
                state.event.set()
        elif isinstance(msg, SchedulerFailed):  # rank 0 lost a (maybe remote) rank; it exits
            self.peer_failure = msg.message  # next, with the exit codes, in the reason
        elif isinstance(msg, SchedulerStats | FlushCacheResult):
            fut = self._reply_waiters.pop(msg.req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _on_output(self, out: ReqOutput) -> None:
        state = self.states.get(out.rid)
        if state is None or state.finish is not None:
            return  # finished already (stop string) or abandoned
        now = time.perf_counter()
        if out.new_token_ids:
            if self.metrics is not None:
                gap = None if state.last_token_at is None else now - state.last_token_at
                self.metrics.tokens(len(out.new_token_ids), gap)
                if state.first_token_at is None:
                    self.metrics.first_token(now - state.created)
            if state.first_token_at is None:
                state.first_token_at = now
            state.last_token_at = now
            state.output_ids.extend(out.new_token_ids)
            state.logprobs.extend(out.new_logprobs)
            state.top_logprobs.extend(out.new_top_logprobs)
        state.cached_tokens = out.cached_tokens
        if out.input_logprobs is not None:
            state.input_logprobs = out.input_logprobs
        if out.input_top_logprobs is not None:
            state.input_top_logprobs = out.input_top_logprobs
        finish = out.finish
        if state.detok is not None:
            state.detok.add(out.new_token_ids, final=finish is not None)
            if state.detok.matched_stop is not None:
                finish = FinishReason("stop", matched=state.detok.matched_stop)
                if out.finish is None:
                    self._send(AbortReq(out.rid))  # free it now; later tokens are ignored
        if finish is not None and finish.kind == "abort":
            # The client's own aborts end the state before the scheduler answers (see above), so
            # this is the server's: a failed forward. The client gets an error, not a short text.
            why = finish.message or "aborted"
            if any(p.exitcode is not None for p in self.handle.procs):  # a collective broke
                why = f"{self._dead_ranks_reason()} ({why})"
            state.error = RequestError(f"the request failed: {why}", 500)
            state.event.set()
            return
        if finish is not None:
            state.finish = finish
            if self.metrics is not None:
                self.metrics.finished(
                    finish.kind, now - state.created, len(state.prompt_ids), state.cached_tokens
                )
        state.event.set()

    # --- requests ------------------------------------------------------------------------------

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        check_one_kind(req.text, req.input_ids)
        if req.input_ids is not None:
            ids = req.input_ids
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise RequestError("input_ids must be a list of integers")
            vocab = self.info.vocab_size
            bad = [t for t in ids if t < 0 or t >= vocab]
            if bad:
                raise RequestError(f"input_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        else:  # text (check_one_kind ruled out neither)
            if not isinstance(req.text, str):
                raise RequestError("text must be a string")
            if self.tokenizer is None:
                raise RequestError(
                    "this server runs with --skip-tokenizer-init: send input_ids, not text"
                )
            check_text(req.text, "the prompt")
            limit = self.max_prompt_chars
            if limit is not None and len(req.text) > limit:
                raise RequestError(
                    f"the prompt is {len(req.text)} characters long, which cannot fit the context "
                    f"length of {self.info.context_length} tokens (at most {limit} characters "
                    "are tokenized); shorten the prompt"
                )
            ids = self.tokenizer.encode(req.text) if req.text else []
        if not ids:
            raise RequestError("the prompt is empty")
        return list(ids)

    def _check_budget(self, req: GenerateRequest, n: int) -> None:
        ctx = self.info.context_length
        name = req.max_tokens_param
        if n >= ctx:
            raise RequestError(
                f"the prompt is {n} tokens long but the context length is {ctx} tokens "
                f"(room is needed for at least one new token); shorten the prompt"
            )
        wanted = req.sampling_params.max_new_tokens
        if wanted is not None and n + wanted > ctx:
            # Rejected, not clamped (as SGLang and vLLM do): a client asking for 10**9 tokens
            # must learn the limit, not wait for a silently shortened answer.
            raise RequestError(
                f"the context length is {ctx} tokens, but this request asks for {n + wanted} "
                f"({n} in the prompt + {wanted} {name}); lower {name} to at most {ctx - n} or "
                "shorten the prompt"
            )
        max_new = ctx - n if wanted is None else wanted
        total = self.info.max_total_tokens
        if n + max_new > total:
            raise RequestError(
                f"the request needs {n + max_new} tokens (prompt {n} + {name} {max_new}) "
                f"but the server's token budget (--max-total-tokens) is {total}; lower "
                f"{name} or shorten the prompt"
            )
        vocab = self.info.vocab_size
        outside = [t for t, _ in req.sampling_params.logit_bias if t >= vocab]
        if outside:
            raise RequestError(
                f"logit_bias names token ids {outside[:5]} outside the vocabulary [0, {vocab})"
            )
        if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]")
        if req.logprob_start_len != -1 and not 0 <= req.logprob_start_len < n:
            raise RequestError(
                f"logprob_start_len must be -1 or in [0, {n}) for a {n}-token prompt"
            )

    def check_admitting(self) -> None:
        """Raise the 503 a new request gets while the server cannot take it."""
        if not self.scheduler_alive:
            why = self.fatal_error or "the scheduler process exited"
            raise RequestError(f"the engine is not running ({why})", 503)
        if self.draining:
            raise RequestError("the server is shutting down and takes no new requests", 503)

    def _prepare_sync(self, req: GenerateRequest) -> PreparedRequest:
        ids = self._prompt_ids(req)
        self._check_budget(req, len(ids))
        return PreparedRequest(req, ids)

    # --- structured output and reasoning -------------------------------------------------------

    async def check_grammar(self, spec: GrammarSpec) -> None:
        """Raise a 400 naming the problem when ``spec`` cannot run here: structured output is
        off, the grammar is invalid or over a limit. Checked off the event loop, with a cache
        keyed by the spec."""
        if self.grammar_backend == "none":
            raise RequestError(
                "structured output is off on this server (--grammar-backend none, or xgrammar "
                "is not installed)"
            )
        if self.tokenizer is None:
            raise RequestError("structured output needs a tokenizer (--skip-tokenizer-init)")
        key = spec.key
        if key in self._checked_grammars:
            self._checked_grammars.move_to_end(key)
            error = self._checked_grammars[key]
        else:
            try:
                await asyncio.wait_for(
                    self.run_blocking(build_grammar, spec, self.grammar_limits),
                    self.grammar_limits.compile_timeout_s,
                )
                error = None
            except GrammarError as exc:
                error = str(exc)
            except asyncio.TimeoutError:
                error = timeout_message(spec, self.grammar_limits)
            self._checked_grammars[key] = error
            while len(self._checked_grammars) > _CHECKED_GRAMMARS:
                self._checked_grammars.popitem(last=False)
        if error is not None:
            raise RequestError(error)

    async def _resolve_grammar(self, req: GenerateRequest) -> GenerateRequest:
        spec = req.grammar
        if spec is None:
            given = req.sampling_params.grammar_param
            if given is None:
                return req
            spec = GrammarSpec(given[0], given[1])
        await self.check_grammar(spec)
        return req if spec is req.grammar else dataclasses.replace(req, grammar=spec)

    def reasoning_end_ids(self, end_marker: str) -> tuple[int, ...]:
        """The token ids of a format's end-of-thinking marker."""
        ids = self._end_ids.get(end_marker)
        if ids is None:
            assert self.tokenizer is not None
            ids = tuple(self.tokenizer.encode(end_marker, add_special_tokens=False))
            self._end_ids[end_marker] = ids
        return ids

    def _skip_ids_keeping(self, keep: tuple[str, ...]) -> frozenset[int]:
        """Special-token ids the text drops, except the tokens that spell ``keep`` markup."""
        skip = self._skip_ids.get(keep)
        if skip is None:
            tok = self.tokenizer
            assert tok is not None
            specials = tok.special_token_ids()
            texts = {i: tok.id_to_token_text(i) for i in specials}
            kept = {i for i, t in texts.items() if t and any(t in m for m in keep)}
            skip = self._skip_ids[keep] = frozenset(specials - kept)
        return skip

    async def prepare(self, req: GenerateRequest) -> PreparedRequest:
        """Validate and tokenize now (off the event loop), so a streaming endpoint can answer
        4xx before it starts its response. Raises :class:`RequestError`."""
        self.check_admitting()
        req = await self._resolve_grammar(req)
        if req.text:
            prepared = await self.run_blocking(self._prepare_sync, req)
        else:
            prepared = self._prepare_sync(req)
        if req.rid is not None and req.rid in self.states:
            raise RequestError(f"a request with rid {req.rid!r} is already running")
        return prepared

    async def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], options: ChatOptions
    ) -> tuple[ChatPrompt, list[int]]:
        """The chat encoding applied and tokenized (segment by segment), off the event loop."""
        tok, fmt = self.tokenizer, self.chat_format
        if tok is None or fmt is None:
            raise RequestError(
                "chat needs a tokenizer; this server runs with --skip-tokenizer-init"
            )
        limit = self.max_prompt_chars
        total = sum(len(str(m.get("content") or "")) for m in messages)
        if limit is not None and total > limit:
            raise RequestError(
                f"the messages hold {total} characters, which cannot fit the context length of "
                f"{self.info.context_length} tokens; shorten them"
            )

        def render() -> tuple[ChatPrompt, list[int]]:
            try:
                prompt = fmt.encoding.render(messages, options)
            except ChatEncodingError as exc:  # the template's own errors included
                raise RequestError(str(exc)) from None
            return prompt, tok.encode_segments(prompt.segments)

        return await self.run_blocking(render)

    async def generate(
        self, request: GenerateRequest | PreparedRequest
    ) -> AsyncIterator[dict[str, Any]]:
        """Run one prompt. Yields results (see :meth:`_result`): every update when
        ``stream``, else only the final one. Raises :class:`RequestError`."""
        prepared = request if isinstance(request, PreparedRequest) else await self.prepare(request)
        req, ids = prepared.request, prepared.input_ids
        self.check_admitting()
        rid = req.rid or uuid.uuid4().hex
        if rid in self.states:
            raise RequestError(f"a request with rid {rid!r} is already running")
        params = req.sampling_params
        detok = None
        if self.tokenizer is not None:
            skip_ids = None
            if req.keep_tokens and params.skip_special_tokens:
                skip_ids = self._skip_ids_keeping(req.keep_tokens)
            detok = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                skip_ids=skip_ids,
            )
        state = _ReqState(rid, ids, req, detok, created=time.perf_counter())
        self.states[rid] = state
        self._send(
            TokenizedGenerateReq(
                rid=rid,
                input_ids=ids,
                sampling_params=params,
                return_logprob=req.return_logprob,
                top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
                logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
                grammar=req.grammar,
                reasoning=req.reasoning,
            )
        )
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                if state.error is not None:
                    raise state.error
                done = state.finish is not None
                if req.stream or done:
                    yield self._result(state)
                if done:
                    return
        finally:
            if state.finish is None and state.error is None:
                # The consumer left early (client disconnect or cancellation): free the request.
                state.finish = FinishReason("abort", message="client disconnected")
                self._send(AbortReq(rid))
                if self.metrics is not None:
                    self.metrics.finished("abort", time.perf_counter() - state.created, len(ids))
            self.states.pop(rid, None)

    async def generate_one(self, req: GenerateRequest | PreparedRequest) -> dict[str, Any]:
        """The final result of a non-streaming request."""
        result: dict[str, Any] | None = None
        async for result in self.generate(req):
            pass
        assert result is not None
        return result

    def abort(self, rid: str) -> bool:
        state = self.states.get(rid)
        if state is None or state.finish is not None:
            return False
        state.finish = FinishReason("abort", message="aborted by request")
        self._send(AbortReq(rid))
        state.event.set()
        return True

    async def _ask_scheduler(self, request: Callable[[int], object], timeout_s: float) -> Any:
        """Send rank 0 ``request(req_id)`` and wait for its reply, the message that carries the
        same ``req_id`` (a scheduler that dies meanwhile fails the wait)."""
        if not self.scheduler_alive:
            raise RequestError("the scheduler process exited", 503)
        req_id = next(self._reply_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._reply_waiters[req_id] = fut
        self._send(request(req_id))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._reply_waiters.pop(req_id, None)

    async def get_stats(self, timeout_s: float = 10.0) -> SchedulerStats:
        stats: SchedulerStats = await self._ask_scheduler(StatsReq, timeout_s)
        if self.metrics is not None:
            self.metrics.scheduler(stats)
        return stats

    async def flush_cache(self, timeout_s: float = 30.0) -> FlushCacheResult:
        """Drop every cached prefix (the scheduler refuses while requests run or wait)."""
        result: FlushCacheResult = await self._ask_scheduler(FlushCacheReq, timeout_s)
        return result

    # --- results -------------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.id_to_token_text(token_id)

    def _result(self, state: _ReqState) -> dict[str, Any]:
        finished = state.finish is not None
        text = "" if state.detok is None else state.detok.visible_text(finished)
        meta: dict[str, Any] = {
            "id": state.rid,
            "prompt_tokens": len(state.prompt_ids),
            "completion_tokens": len(state.output_ids),
            "cached_tokens": state.cached_tokens,
            "finish_reason": None if state.finish is None else state.finish.to_json(),
            "e2e_latency": time.perf_counter() - state.created,
        }
        if state.request.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tid, self._token_text(tid)]
                for lp, tid in zip(state.logprobs, state.output_ids)
            ]
            if state.request.top_logprobs_num:
                meta["output_top_logprobs"] = [
                    None if top is None else [[lp, tid, self._token_text(tid)] for tid, lp in top]
                    for top in state.top_logprobs
                ]
            if state.input_logprobs is not None:
                start = state.request.logprob_start_len
                meta["input_token_logprobs"] = [
                    [lp, tid, self._token_text(tid)]
                    for lp, tid in zip(state.input_logprobs, state.prompt_ids[start:])
                ]
            if state.input_top_logprobs is not None:
                meta["input_top_logprobs"] = [
                    None if top is None else [[lp, tid, self._token_text(tid)] for tid, lp in top]
                    for top in state.input_top_logprobs
                ]
        return {"text": text, "output_ids": list(state.output_ids), "meta_info": meta}
