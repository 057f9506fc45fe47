"""The offline engine: the server's machinery without HTTP, for scripts and tests.

``Engine(**options)`` takes the server's options (``ServerArgs`` field names: ``model_path``,
``tp_size``, ``max_total_tokens`` ...), starts the same scheduler processes, and runs the
tokenizer manager on a private event loop in a background thread, so ``generate`` is a plain
blocking call. Same options and requests as the server, same tokens.

    engine = Engine()                      # the built-in default model
    out = engine.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
    out["text"], out["output_ids"], out["meta_info"]
    engine.shutdown()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from sglang.srt.entrypoints.startup import start_engine
from sglang.srt.managers.generate_request import GenerateRequest
from sglang.srt.managers.prompts import build_requests
from sglang.srt.managers.request_error import RequestError
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

T = TypeVar("T")


class Engine:
    def __init__(self, server_args: ServerArgs | None = None, **kwargs: Any) -> None:
        if server_args is not None and kwargs:
            raise TypeError("give either server_args or keyword options, not both")
        started = start_engine(server_args or ServerArgs(**kwargs))
        self.server_args = started.server_args
        self._started = started
        self.tokenizer_manager = started.tokenizer_manager
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="sglang-engine-loop", daemon=True
        )
        self._thread.start()
        self.tokenizer_manager.start(self._loop)
        self._closed = False

    # --- helpers -------------------------------------------------------------------------------

    def _run(self, coro: Any) -> Any:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result()

    @staticmethod
    def _requests(
        prompt: str | list[str] | None,
        input_ids: list[int] | list[list[int]] | None,
        sampling_params: Any,
        template: GenerateRequest,
    ) -> tuple[list[GenerateRequest], bool]:
        built = build_requests(
            prompt, input_ids, sampling_params, template, text_name="a prompt", allow_empty=True
        )
        reqs = built.requests
        return reqs, built.batch or len(reqs) > 1

    # --- API -----------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: Mapping[str, Any] | SamplingParams | list[Any] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
    ) -> Any:
        """Generate for one prompt (a dict result) or a list (a list of results, run together).
        With ``stream`` (one prompt only) returns an iterator of growing results.
        Results: ``{"text", "output_ids", "meta_info": {"prompt_tokens", "completion_tokens",
        "finish_reason", "output_token_logprobs", ...}}``. Raises :class:`RequestError`."""
        reqs, batch = self._requests(
            prompt,
            input_ids,
            sampling_params,
            GenerateRequest(
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len,
                stream=stream,
            ),
        )
        tm = self.tokenizer_manager
        if stream:
            if batch:
                raise RequestError("streaming takes one prompt")
            return self._iterate(tm.generate(reqs[0]))

        async def run_all() -> list[dict[str, Any]]:
            return list(await asyncio.gather(*(tm.generate_one(r) for r in reqs)))

        results = self._run(run_all())
        return results if batch else results[0]

    def _iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed:
                self._run(agen.aclose())  # an abandoned stream aborts its request

    def get_server_info(self) -> dict[str, Any]:
        import dataclasses

        stats = self._run(self.tokenizer_manager.get_stats())
        return {
            "server_args": self.server_args.to_dict(),
            "model_info": dataclasses.asdict(self.tokenizer_manager.info),
            "scheduler": dataclasses.asdict(stats),
        }

    def flush_cache(self) -> dict[str, Any]:
        """Drop every cached prefix; ``{"ok": bool, "message": str}`` (not ok while requests run
        or wait)."""
        result = self._run(self.tokenizer_manager.flush_cache())
        return {"ok": result.ok, "message": result.message}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._started.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> Engine:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001, S110 - interpreter teardown: nothing left to tell
            pass
