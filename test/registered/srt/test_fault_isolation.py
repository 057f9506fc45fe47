"""Fault isolation below the HTTP layer, in process (no model, no network):

- the scheduler: an exception while admitting or sampling one request fails that request alone
  (a 500 ReqError naming it); the others in its batch finish, the loop keeps serving, and the
  failed request's reservation is returned;
- the tokenizer manager: tokenization runs off the event loop (a ticker on the loop keeps
  ticking while a slow prompt is prepared), and the tokenizer releases the GIL while it works;
- the ASGI guard: an unhandled exception in a route is a JSON 500 for that request only, the next
  request on the same app succeeds; the body-size limit answers 413 naming the flag.
"""

from __future__ import annotations

import asyncio
import threading
import time
from multiprocessing import Pipe
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI, Request

from sglang.srt.entrypoints.middleware import GuardMiddleware
from sglang.srt.managers import scheduler as scheduler_module
from sglang.srt.managers.io_struct import (
    BatchOutput,
    ModelInfo,
    ReqError,
    ShutdownReq,
    TokenizedGenerateReq,
)
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tokenizer_manager import GenerateRequest, TokenizerManager
from sglang.srt.model_executor.forward_plan import ForwardPlan
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=10)

V = 32
POISON_SEED = 666  # sampling this request raises
BAD_ADMIT_SEED = 777  # admitting this request raises


class _FakeRunner:
    device = torch.device("cpu")
    vocab_size = V

    def __init__(self) -> None:
        self.caches: dict[str, Any] = {}

    def execute(self, plan: ForwardPlan) -> torch.Tensor | None:
        for rid in plan.free_rids:
            self.caches.pop(rid, None)
        for rid in plan.new_rids:
            self.caches[rid] = object()
        if not plan.has_forward:
            return None
        return torch.randn(len(plan.output_rows), V)


def _run_scheduler(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Scheduler, threading.Thread]:
    real_sample, real_gen = scheduler_module.sample, scheduler_module.make_generator

    def sample(logits: torch.Tensor, rows: Any, gen: Any, token_bitmask: Any = None) -> Any:
        if any(r.params.seed == POISON_SEED for r in rows):
            raise RuntimeError("injected sampling fault")
        return real_sample(logits, rows, gen, token_bitmask)

    def make_generator(seed: int, device: torch.device) -> torch.Generator:
        if seed == BAD_ADMIT_SEED:
            raise ValueError("injected admission fault")
        return real_gen(seed, device)

    monkeypatch.setattr(scheduler_module, "sample", sample)
    monkeypatch.setattr(scheduler_module, "make_generator", make_generator)
    down_recv, down_send = Pipe(duplex=False)
    up_recv, up_send = Pipe(duplex=False)
    sched = Scheduler(
        _FakeRunner(),  # type: ignore[arg-type]
        SimpleNamespace(world_size=1),
        context_length=256,
        eos_token_ids=[],
        max_total_tokens=4096,
        max_running_requests=8,
        chunked_prefill_size=64,
        random_seed=0,
        recv=down_recv,
        send=up_send,
    )
    t = threading.Thread(target=sched.run, daemon=True)
    t.start()
    return down_send, up_recv, sched, t


def _req(rid: str, seed: int | None = None, n: int = 6) -> TokenizedGenerateReq:
    params = SamplingParams(max_new_tokens=n, seed=seed, ignore_eos=True)
    return TokenizedGenerateReq(rid=rid, input_ids=[1, 2, 3], sampling_params=params)


def _collect(up: Any, want: set[str], timeout_s: float = 20.0) -> dict[str, Any]:
    """rid -> its final ReqOutput or ReqError, for every rid in ``want``."""
    done: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while set(done) < want and time.monotonic() < deadline:
        if not up.poll(0.1):
            continue
        msg = up.recv()
        if isinstance(msg, ReqError):
            done[msg.rid] = msg
        elif isinstance(msg, BatchOutput):
            for out in msg.outputs:
                if out.finish is not None:
                    done[out.rid] = out
    return done


def test_one_failing_request_does_not_stop_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    down, up, sched, thread = _run_scheduler(monkeypatch)
    try:
        for msg in (
            _req("good-1"),
            _req("poison", POISON_SEED),
            _req("bad-admit", BAD_ADMIT_SEED),
            _req("good-2", 5),
        ):
            down.send(msg)
        done = _collect(up, {"good-1", "poison", "bad-admit", "good-2"})
        assert isinstance(done["poison"], ReqError) and done["poison"].status_code == 500
        assert "injected sampling fault" in done["poison"].message
        assert isinstance(done["bad-admit"], ReqError) and done["bad-admit"].status_code == 500
        assert "injected admission fault" in done["bad-admit"].message
        for rid in ("good-1", "good-2"):
            assert done[rid].finish.kind == "length" and done[rid].completion_tokens == 6
        # Still serving, and nothing of the failed requests is held.
        down.send(_req("after"))
        after = _collect(up, {"after"})["after"]
        assert after.finish.kind == "length" and after.completion_tokens == 6
        assert thread.is_alive()
        deadline = time.monotonic() + 5
        while (sched.policy.reserved or sched.policy.running) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sched.policy.reserved == 0 and not sched.policy.running
    finally:
        down.send(ShutdownReq())
        thread.join(10)
    assert not thread.is_alive()


class _SlowTokenizer:
    """encode sleeps (releasing the GIL, as the real tokenizer's encode does)."""

    bos_token_id = None
    bos_token = eos_token = None
    has_own_chat_template = False
    chat_template = ""
    longest_token_chars = 4

    def token_id(self, text: str) -> int | None:
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        time.sleep(0.8)
        return [1] * 8


def _tokenizer_manager(tokenizer: Any) -> TokenizerManager:
    info = ModelInfo(
        model_path="m",
        architecture="A",
        vocab_size=V,
        context_length=256,
        eos_token_ids=[],
        max_total_tokens=4096,
        max_running_requests=8,
        chunked_prefill_size=64,
        dtype="float32",
        device="cpu",
        moe_runner="torch",
        moe_a2a_backend="none",
        symm_mem="off",
        mega_moe_sm_budget=None,
        cuda_graph="off",
    )
    handle = SimpleNamespace(model_info=info, procs=[])
    return TokenizerManager(ServerArgs(model_path="m"), handle, tokenizer)  # type: ignore[arg-type]


def test_prepare_tokenizes_off_the_event_loop() -> None:
    tm = _tokenizer_manager(_SlowTokenizer())

    async def main() -> tuple[float, int]:
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        prepared = await tm.prepare(GenerateRequest(text="some prompt"))
        tick.cancel()
        return max(gaps), len(prepared.input_ids)

    try:
        worst_gap, n = asyncio.run(main())
    finally:
        tm.close()
    assert n == 8
    assert worst_gap < 0.5, worst_gap  # the 0.8 s encode ran elsewhere


def test_tokenizer_releases_the_gil() -> None:
    from sglang.srt.default_model.generate import ensure_default_model
    from sglang.srt.managers.tokenizer import load_tokenizer

    tok = load_tokenizer(ensure_default_model())
    text = "hello world " * 60000
    t0 = time.perf_counter()
    tok.encode(text)
    encode_s = time.perf_counter() - t0
    gaps: list[float] = []
    stop = threading.Event()

    def beat() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=beat)
    t.start()
    worker = threading.Thread(target=tok.encode, args=(text,))
    worker.start()
    worker.join()
    stop.set()
    t.join()
    assert max(gaps) < max(0.05, encode_s / 2), (max(gaps), encode_s)


def _guarded_app() -> Any:
    app = FastAPI()

    @app.post("/boom")
    async def boom() -> dict[str, str]:
        raise KeyError("injected route fault")

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"n": len(await request.body())}

    # As the server installs it: inside Starlette's own error middleware, which would answer
    # a plain-text 500 and re-raise.
    app.add_middleware(GuardMiddleware, max_body_bytes=1024, api_key=None)
    return app


def test_guard_turns_a_route_exception_into_json_500() -> None:
    async def main() -> None:
        transport = httpx.ASGITransport(app=_guarded_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post("/boom")
            assert r.status_code == 500
            err = r.json()["error"]
            assert "KeyError" in err["message"] and "injected route fault" in err["message"]
            assert err["type"] == "InternalServerError"
            ok = await client.post("/echo", content=b"x" * 10)
            assert ok.status_code == 200 and ok.json() == {"n": 10}
            big = await client.post("/echo", content=b"x" * 2000)
            assert (
                big.status_code == 413 and "--max-request-bytes" in big.json()["error"]["message"]
            )

            async def chunks() -> Any:  # no Content-Length: counted as it arrives
                for _ in range(5):
                    yield b"y" * 400

            streamed = await client.post("/echo", content=chunks())
            assert streamed.status_code == 413

    asyncio.run(main())


if __name__ == "__main__":
    run_this_file(__file__)
