"""End to end on CPU: the server on the built-in model, driven by the official ``openai`` client
(completions and chat, streaming and not) and plain HTTP (/generate, /health, /v1/models,
/metrics ...). Greedy output equals the offline Engine's; bad requests get 4xx and the next good
request succeeds; a client that disconnects mid-stream has its request freed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

# Optional clients: a machine without them (the GPU machines) skips this file, not the run.
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from sglang import Engine
from sglang.srt.default_model.tokenizer import BOS_TOKEN
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file
from sglang.test.server_process import ServerProcess

register_cpu_ci(est_time=45)

PROMPT = "Once upon a time there was"
MODEL = "sglang-default-tiny-dsv4"  # the built-in model's served name
MESSAGES = [{"role": "user", "content": "Tell me a story about a robot."}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(
        "--device", "cpu", "--enable-metrics", "--random-seed", "0", "--log-level", "warning"
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = Engine(device="cpu", random_seed=0, log_level="warning")
    yield e
    e.shutdown()


def _get(server: ServerProcess, path: str) -> httpx.Response:
    return httpx.get(server.base_url + path, timeout=30)


def _post(server: ServerProcess, path: str, body: object) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def _scheduler(server: ServerProcess) -> dict[str, int]:
    return _get(server, "/server_info").json()["scheduler"]


def test_health_and_info(server: ServerProcess, client: openai.OpenAI) -> None:
    assert _get(server, "/health").status_code == 200
    assert _get(server, "/health_generate").status_code == 200
    info = _get(server, "/get_model_info").json()
    assert info["architecture"] == "DeepseekV4ForCausalLM" and info["is_generation"]
    models = client.models.list().data
    assert [m.id for m in models] == [info["served_model_name"]]
    sched = _scheduler(server)
    assert sched["num_running_reqs"] == 0 and sched["max_total_tokens"] > 0


def test_completions(client: openai.OpenAI, engine: Engine) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    want = engine.generate(PROMPT, {"max_new_tokens": 10, "temperature": 0})
    assert out.choices[0].text == want["text"]
    assert out.usage is not None and out.usage.completion_tokens == len(want["output_ids"])
    assert out.choices[0].finish_reason in ("length", "stop")
    parts = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(parts)
    assert "".join(c.choices[0].text for c in chunks) == want["text"]
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_completions_logprobs_and_batch(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0, logprobs=2
    )
    assert [c.index for c in out.choices] == [0, 1]
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == 4
    assert all(len(t) >= 1 for t in lp.top_logprobs or [])


def _assert_offsets_index_text(text: str, tokens: list[str], offsets: list[int]) -> None:
    assert len(tokens) == len(offsets) and offsets[0] == 0
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    checked = 0
    for token, off in zip(tokens, offsets):
        if token and "\ufffd" not in token and token != BOS_TOKEN:
            assert text[off : off + len(token)] == token, (token, off, text)
            checked += 1
    assert checked >= len(tokens) // 2


@pytest.mark.parametrize("stream", [False, True])
def test_echo_text_offsets_index_the_text(client: openai.OpenAI, stream: bool) -> None:
    """With echo, the prompt's BOS is listed (no log-prob) but takes no room in the text: every
    text_offset indexes into the returned text (prompt + output)."""
    kwargs: dict[str, object] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6}
    kwargs.update(temperature=0, echo=True, logprobs=1)
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
        assert choice.logprobs is not None
        text, lp = choice.text, choice.logprobs
        tokens, offsets = lp.tokens or [], lp.text_offset or []
    else:
        text, tokens, offsets = "", [], []
        for chunk in client.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
            c = chunk.choices[0]
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                offsets += c.logprobs.text_offset or []
    assert text.startswith(PROMPT) and tokens[0] == BOS_TOKEN
    _assert_offsets_index_text(text, tokens, offsets)
    assert offsets[1] == 0  # the first prompt word starts the text: BOS took no room


def test_chat(client: openai.OpenAI, engine: Engine) -> None:
    tok = engine.tokenizer_manager.tokenizer
    assert tok is not None  # the built-in model chats in DeepSeek V4's encoding, thinking off
    ids = tok.encode(f"{BOS_TOKEN}<｜User｜>{MESSAGES[0]['content']}<｜Assistant｜></think>")
    want = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0})
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,  # type: ignore[arg-type]
    )
    assert out.choices[0].message.content == want["text"]
    assert out.choices[0].logprobs is not None
    assert len(out.choices[0].logprobs.content or []) == len(want["output_ids"])
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want["text"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(
        want["output_ids"]
    )


def test_native_generate(server: ServerProcess, engine: Engine) -> None:
    params = {"max_new_tokens": 8, "temperature": 0}
    r = _post(
        server, "/generate", {"text": PROMPT, "sampling_params": params, "return_logprob": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    want = engine.generate(PROMPT, params)
    assert body["output_ids"] == want["output_ids"] and body["text"] == want["text"]
    assert len(body["meta_info"]["output_token_logprobs"]) == 8
    batch = _post(
        server, "/generate", {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": params}
    )
    assert batch.status_code == 200 and len(batch.json()) == 2
    with httpx.stream(
        "POST",
        server.base_url + "/generate",
        timeout=60,
        json={"text": PROMPT, "sampling_params": params, "stream": True},
    ) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json

    assert json.loads(lines[-2][6:])["text"] == want["text"]


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"prompt": "", "max_tokens": 3}, "empty"),
        ("/v1/completions", {"prompt": "hi " * 5000, "max_tokens": 3}, "context length"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 3}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/generate", {"text": "hi", "sampling_params": {"top_p": 7}}, "top_p"),
        ("/generate", {"text": "hi", "sampling_params": {"nope": 1}}, "nope"),
        ("/generate", {"input_ids": [1, -2]}, "vocabulary"),
        ("/generate", {"text": 5}, "text"),
        ("/generate", [1, 2], "JSON object"),
    ],
)
def test_bad_requests_then_good(
    server: ServerProcess, path: str, body: object, needle: str
) -> None:
    r = _post(server, path, body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert needle in r.json()["error"]["message"], r.text
    good = _post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert good.status_code == 200 and good.json()["meta_info"]["completion_tokens"] == 2


def test_openai_client_sees_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="", max_tokens=3)


def _wait_until(predicate: object, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_disconnect_mid_stream_frees_request(server: ServerProcess, path: str) -> None:
    if path == "/generate":
        body = {
            "text": PROMPT,
            "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        }
    else:
        body = {"prompt": PROMPT, "stream": True, "max_tokens": 3000, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + path, json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
        sched = _scheduler(server)
        assert sched["num_running_reqs"] == 1 and sched["num_active_caches"] == 1
    # The connection is closed: the server aborts the request and every rank drops its cache.
    assert _wait_until(
        lambda: (s := _scheduler(server))["num_active_caches"] == 0 and s["num_running_reqs"] == 0
    ), _scheduler(server)


def test_disconnect_while_waiting_frees_request(server: ServerProcess) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/generate", json=body, timeout=1.5)
    assert _wait_until(
        lambda: (s := _scheduler(server))["num_active_caches"] == 0 and s["num_running_reqs"] == 0
    ), _scheduler(server)


def test_metrics(server: ServerProcess) -> None:
    _post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    text = _get(server, "/metrics").text
    for name in (
        "sglang:num_requests_total",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:e2e_request_latency_seconds_count",
        "sglang:inter_token_latency_seconds_count",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
    ):
        assert name in text, name


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_bench_serving(server: ServerProcess, backend: str) -> None:
    from sglang.bench_serving import build_parser, run_benchmark

    args = build_parser().parse_args(
        [
            "--base-url",
            server.base_url,
            "--backend",
            backend,
            "--num-prompts",
            "6",
            "--max-concurrency",
            "3",
            "--random-input-len",
            "24",
            "--random-output-len",
            "6",
            "--dataset-name",
            "fixed",
            "--request-rate",
            "50",
        ]
    )
    m = run_benchmark(args)
    assert m["completed"] == 6 and m["failed"] == 0, m["errors"]
    assert m["total_output_tokens"] == 36
    if backend != "sglang-oai-chat":
        assert m["total_input_tokens"] == 6 * 24
    assert 0 < m["ttft_ms"]["mean"] <= m["e2e_ms"]["mean"] and m["tpot_ms"]["mean"] > 0
    assert m["output_throughput"] > 0


if __name__ == "__main__":
    run_this_file(__file__)
