"""What rank 0 does for structured output and the thinking budget around each sampling step:
requests wait for their grammar to compile before they are admitted; each step gets one bitmask
for its sampled rows (rows without an active grammar all ones) and the tokens a spent thinking
budget forces; every sampled token then advances its request's reasoning tracker and grammar
(which starts once the reasoning has ended)."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from sglang.srt.constrained.grammar_compiler import GrammarCompiler, timeout_message
from sglang.srt.constrained.grammar_spec import GrammarError, GrammarLimits, GrammarSpec
from sglang.srt.constrained.request_grammar import RequestGrammar, fill_bitmasks
from sglang.srt.constrained.tokenizer_vocab import VocabSource
from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.tokenizer import TextTokenizer, load_tokenizer
from sglang.srt.sampling.token_bitmask import BitmaskBuffer
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)


def grammar_limits() -> GrammarLimits:
    return GrammarLimits(
        max_bytes=envs.SGLANG_GRAMMAR_MAX_BYTES.get(),
        max_depth=envs.SGLANG_GRAMMAR_MAX_DEPTH.get(),
        compile_timeout_s=envs.SGLANG_GRAMMAR_COMPILE_TIMEOUT_S.get(),
        max_whitespace=envs.SGLANG_GRAMMAR_MAX_WHITESPACE.get(),
    )


def vocab_source(tok: TextTokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> VocabSource:
    entries = tok.vocab()
    added = {i: entries[i] for i in tok.added_token_ids() if i < len(entries)}
    byte_level = tok.decoder_kind in ("ByteLevel",)
    size = max(vocab_size, len(entries))
    return VocabSource(entries, added, byte_level, size, list(stop_token_ids))


def grammar_backend_in_use(requested: str) -> str:
    """``--grammar-backend`` as it can run here: ``none`` when xgrammar is not installed."""
    import importlib.util

    if requested == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
        return "none"
    return requested


def make_grammar_compiler(
    grammar_backend: str, tokenizer_path: str | None, vocab_size: int, stop_token_ids: Sequence[int]
) -> GrammarCompiler | None:
    """Rank 0's compiler (the tokenizer loads on the first grammar, in the compile thread);
    None when structured output is off or there is no tokenizer."""
    if grammar_backend == "none" or tokenizer_path is None:
        return None
    path = tokenizer_path

    @functools.cache
    def tokenizer() -> TextTokenizer:
        return load_tokenizer(path)

    def vocab() -> VocabSource:
        return vocab_source(tokenizer(), vocab_size, stop_token_ids)

    def encode(text: str) -> list[int]:
        return tokenizer().encode(text, add_special_tokens=False)

    return GrammarCompiler(vocab, grammar_limits(), encode=encode)


@dataclass
class _Pending:
    req: Req
    spec: GrammarSpec
    future: Future[Any]
    since: float


class GrammarQueue:
    """Requests whose grammar is compiling; a request leaves it admitted (its matcher set) or
    failed (the message says why: a 400 for the client's grammar, a 500 otherwise)."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, req: Req, spec: GrammarSpec) -> str | None:
        """Queue ``req``; the reason it cannot have a grammar, if so."""
        if self.compiler is None:
            return "structured output is off on this server (--grammar-backend none)"
        self._pending[req.rid] = _Pending(req, spec, self.compiler.submit(spec), time.monotonic())
        return None

    def remove(self, rid: str) -> Req | None:
        pending = self._pending.pop(rid, None)
        return None if pending is None else pending.req

    def poll(self) -> tuple[list[Req], list[tuple[Req, str, int]]]:
        """(requests ready to admit, (request, message, status) of the failed)."""
        ready: list[Req] = []
        failed: list[tuple[Req, str, int]] = []
        assert self.compiler is not None or not self._pending
        now = time.monotonic()
        for rid, p in list(self._pending.items()):
            if not p.future.done():
                if now - p.since > self.compiler.limits.compile_timeout_s:  # type: ignore[union-attr]
                    del self._pending[rid]
                    failed.append((p.req, timeout_message(p.spec, self.compiler.limits), 400))  # type: ignore[union-attr]
                continue
            del self._pending[rid]
            exc = p.future.exception()
            if isinstance(exc, GrammarError):
                failed.append((p.req, str(exc), 400))
            elif exc is not None:
                logger.error(f"compiling the grammar of {rid} failed: {exc!r}")
                failed.append((p.req, f"internal error compiling the grammar: {exc!r}", 500))
            else:
                tracker = p.req.reasoning
                active = tracker is None or not tracker.in_reasoning
                p.req.grammar = RequestGrammar(p.future.result(), active=active)
                ready.append(p.req)
        return ready, failed


def step_constraints(
    reqs: Sequence[Req], buffer: BitmaskBuffer, compiler: GrammarCompiler | None = None
) -> tuple[torch.Tensor | None, list[int | None]]:
    """The step's bitmask (None when no row is constrained) and forced tokens, per sampled row:
    a spent thinking budget's end marker, or the first token of text the grammar forces."""
    forced = [None if r.reasoning is None else r.reasoning.forced_token() for r in reqs]
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.constrains]
    rows = [i for i in rows if forced[i] is None]
    if not rows:
        return None, forced
    bitmask = buffer.rows(len(reqs))
    grammars = [reqs[i].grammar for i in rows]
    fill_bitmasks(grammars, bitmask, rows)  # type: ignore[arg-type]
    if compiler is not None:
        for i, grammar in zip(rows, grammars):
            assert grammar is not None
            token = compiler.first_token(grammar.forced_text())
            if token is not None and token < buffer.vocab_size and _allowed(bitmask, i, token):
                forced[i] = token
    return bitmask, forced


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def advance(req: Req, token: int) -> str | None:
    """After ``token`` is sampled for ``req``: the reason to fail the request, if any."""
    ended = False
    if req.reasoning is not None:
        ended = req.reasoning.observe(token)
    grammar = req.grammar
    if grammar is None:
        return None
    if ended:
        grammar.active = True  # the answer starts with the next token
    elif grammar.active and not grammar.terminated and not grammar.accept(token):
        return f"the grammar rejected token {token}"
    return None
