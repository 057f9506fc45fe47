"""Compiling grammars off the loop that would otherwise wait, with a cache keyed by the spec
(the schema text and its wrapping): the scheduler submits a request's grammar when it arrives and
admits the request once the grammar is ready, so decoding never waits for a compile."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sglang.srt.constrained.grammar_spec import (
    GrammarError,
    GrammarLimits,
    GrammarSpec,
    build_grammar,
)
from sglang.srt.constrained.tokenizer_vocab import VocabSource, tokenizer_info


class GrammarCompiler:
    """``submit(spec)`` -> a future of xgrammar's ``CompiledGrammar``; the same spec twice shares
    one compilation (the last ``cache_size`` specs are kept)."""

    def __init__(
        self,
        vocab: Callable[[], VocabSource],
        limits: GrammarLimits,
        *,
        encode: Callable[[str], list[int]] | None = None,
        threads: int = 2,
        cache_size: int = 256,
    ) -> None:
        """``encode``: text -> token ids (no special tokens added), for the tokens of text the
        grammar forces."""
        self.limits = limits
        self._vocab = vocab
        self._encode = encode
        self._forced: OrderedDict[str, int | None] = OrderedDict()
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sglang-grammar")
        self._cache: OrderedDict[tuple[str, ...], Future[Any]] = OrderedDict()
        self._cache_size = cache_size
        self.compile_seconds: dict[tuple[str, ...], float] = {}

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self._vocab())
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def warm_up(self) -> None:
        """Build the vocabulary's tables now (the first compile does it otherwise)."""
        self._xgr_compiler()

    def _compile(self, spec: GrammarSpec) -> Any:
        compiler = self._xgr_compiler()
        started = time.perf_counter()
        grammar = build_grammar(spec, self.limits)
        try:
            compiled = compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"the {spec.kind} does not compile: {exc}") from None
        self.compile_seconds[spec.key] = time.perf_counter() - started
        return compiled

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:  # errors are cached too: the same spec fails the same way
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def compile(self, spec: GrammarSpec) -> Any:
        """Compile now (waiting up to the compile-time limit). Raises :class:`GrammarError`."""
        fut = self.submit(spec)
        try:
            return fut.result(timeout=self.limits.compile_timeout_s)
        except TimeoutError:
            raise GrammarError(timeout_message(spec, self.limits)) from None

    def first_token(self, text: str) -> int | None:
        """The first token of ``text`` as the tokenizer spells it (cached by text)."""
        if self._encode is None or not text:
            return None
        if text not in self._forced:
            ids = self._encode(text)
            self._forced[text] = ids[0] if ids else None
            if len(self._forced) > 4096:
                self._forced.popitem(last=False)
        return self._forced[text]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def timeout_message(spec: GrammarSpec, limits: GrammarLimits) -> str:
    return (
        f"the {spec.describe()} did not compile within {limits.compile_timeout_s:g} s "
        "(SGLANG_GRAMMAR_COMPILE_TIMEOUT_S); simplify it"
    )
