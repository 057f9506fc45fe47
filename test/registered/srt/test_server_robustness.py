"""One request must never take the server down (CPU, the built-in model, loopback only).

Every case sends something bad, checks the answer is a 4xx JSON error in OpenAI's shape that
names the problem, then checks that the server still serves (a good request and /health on the
same keep-alive connection). Also: a 5 MB prompt does not stall a concurrent stream or /health;
the strict API (unknown model 404, max_tokens over the room, unsupported parameters), and what
it implements instead of ignoring (n > 1, logit_bias, echo with prompt log-probs, stop_reason).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file
from sglang.test.server_process import ServerProcess

register_cpu_ci(est_time=60)

MODEL = "sglang-default-tiny-dsv4"
CONTEXT = 4096


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess("--device", "cpu", "--random-seed", "0")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:  # one keep-alive connection
        yield c


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _still_serving(http: httpx.Client) -> None:
    good = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] == 2
    assert http.get("/health").status_code == 200


def _error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["code"] == status and err["type"] and isinstance(err["message"], str)
    return str(err["message"])


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"prompt": "hi", "max_tokens": 2}
GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


def _gen(**params: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2, **params}}


# --- numbers at the API edge (the 2**64 seed used to kill the scheduler) -------------------------

NUMERIC = [
    ("/v1/completions", {**COMP, "seed": 2**64}, "seed"),
    ("/v1/completions", {**COMP, "seed": 2**70}, "seed"),
    ("/v1/completions", {**COMP, "seed": -(2**63) - 1}, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**64}, "seed"),
    ("/generate", _gen(seed=2**64), "seed"),
    ("/v1/completions", {**COMP, "temperature": 1e9}, "temperature"),
    ("/v1/completions", {**COMP, "temperature": 10**400}, "temperature"),
    ("/v1/completions", {**COMP, "frequency_penalty": float("inf")}, "frequency_penalty"),
    ("/v1/completions", {**COMP, "top_p": float("nan")}, "top_p"),
    ("/v1/completions", {**COMP, "top_k": -5}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "top_k": 2**70}, "top_k"),
    ("/generate", _gen(top_k=2**64), "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**64}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2**70}, "max_completion_tokens"),
    ("/generate", _gen(max_new_tokens=2**64), "max_new_tokens"),
    ("/v1/completions", {**COMP, "n": 10**6}, "n"),
    ("/v1/completions", {**COMP, "logprobs": 2**64}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2**70}, "top_logprobs"),
    ("/generate", {**GEN, "return_logprob": True, "top_logprobs_num": 2**64}, "top_logprobs_num"),
    ("/generate", {**GEN, "return_logprob": True, "logprob_start_len": 2**64}, "logprob_start_len"),
    ("/generate", {"input_ids": [1, 2**64]}, "vocabulary"),
    ("/v1/completions", {"prompt": [1, 2**70], "max_tokens": 2}, "vocabulary"),
    ("/v1/completions", {**COMP, "stop_token_ids": [2**64]}, "stop_token_ids"),
    ("/v1/completions", {**COMP, "logit_bias": {"5": 1e9}}, "logit_bias"),
    ("/v1/completions", {**COMP, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {**COMP, "repetition_penalty": 1e300}, "repetition_penalty"),
    ("/v1/completions", {"prompt": ["a"] * 100, "max_tokens": 2, "n": 20}, "at most 1024"),
    ("/generate", {"text": ["a"] * 100, "sampling_params": {"n": 20}}, "at most 1024"),
    ("/v1/completions", {**COMP, "stop": ["x"] * 1000}, "stop"),
]


@pytest.mark.parametrize(("path", "body", "needle"), NUMERIC)
def test_numeric_bounds(http: httpx.Client, path: str, body: Any, needle: str) -> None:
    raw = json.dumps(body)  # Infinity / NaN literals too, as Python clients send them
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert needle in _error(r, 400), r.text
    _still_serving(http)


# --- input hygiene --------------------------------------------------------------------------------

HYGIENE: list[tuple[str, bytes, int, str]] = [
    ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 2}', 400, "surrogate"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', 400, "surrogate"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "surrogate",
    ),
    (
        "/generate",
        b'{"text": "\\ud83d", "sampling_params": {"max_new_tokens": 2}}',
        400,
        "surrogate",
    ),
    ("/generate", b'{"text": "hi", "\\ud800": 1}', 400, "surrogate"),
    ("/v1/completions", b'{"x":' + b"[" * 100000, 400, "--max-json-depth"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 80 + b"]" * 80 + b"}", 400, "--max-json-depth"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "JSON"),
    ("/generate", b'{"text": "hi"', 400, "JSON"),
]


@pytest.mark.parametrize(("path", "raw", "status", "needle"), HYGIENE)
def test_input_hygiene(http: httpx.Client, path: str, raw: bytes, status: int, needle: str) -> None:
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert needle in _error(r, status), r.text
    _still_serving(http)


def test_body_size_limit(server: ServerProcess) -> None:
    big = b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}'
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        r = http.post("/v1/completions", content=big)
        assert "--max-request-bytes" in _error(r, 413)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        _still_serving(http)


def test_large_prompt_does_not_stall_others(server: ServerProcess, http: httpx.Client) -> None:
    """A 5 MB prompt is rejected while a stream runs and /health is polled: neither stalls."""
    gaps: list[float] = []
    health: list[float] = []
    done = threading.Event()

    def stream() -> None:
        body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        last = None
        with httpx.stream(
            "POST", server.base_url + "/v1/completions", json=body, timeout=60
        ) as resp:
            for line in resp.iter_lines():
                now = time.perf_counter()
                if line.startswith("data: ") and not done.is_set():
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    def poll() -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                health.append(time.perf_counter() - t0)
                time.sleep(0.02)

    threads = [threading.Thread(target=stream), threading.Thread(target=poll)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    huge = "word " * (1024 * 1024)  # 5 MiB
    for path, body in (
        ("/v1/completions", {"prompt": huge, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ("/generate", {"text": huge}),
    ):
        t0 = time.perf_counter()
        r = http.post(path, json=body)
        assert "context length" in _error(r, 400)
        assert time.perf_counter() - t0 < 10
    time.sleep(0.5)
    done.set()
    for t in threads:
        t.join(60)
    assert gaps and health
    # Before: /health took 4.95 s and the stream stalled 5.48 s.
    assert max(health) < 1.0, max(health)
    assert max(gaps) < 1.5, max(gaps)


# --- strict API
# ------------------------------------------------------------------------------------

STRICT: list[tuple[str, dict[str, Any], int, str]] = [
    ("/v1/completions", {**COMP, "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "nope"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "4093"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    ("/generate", _gen(max_new_tokens=CONTEXT), 400, "context length is 4096"),
    ("/v1/completions", {**COMP, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {**COMP, "suffix": "!"}, 400, "suffix"),
    (
        "/v1/chat/completions",
        {**CHAT, "functions": [{"name": "f"}]},
        400,
        "functions",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "yaml"}},
        400,
        "response_format",
    ),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/completions", {**COMP, "frobnicate": 1}, 400, "frobnicate"),
    ("/generate", {**GEN, "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/completions", {**COMP, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {**COMP, "temperature": "0.5"}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), STRICT)
def test_strict_api(http: httpx.Client, path: str, body: Any, status: int, needle: str) -> None:
    r = http.post(path, json=body)
    assert needle in _error(r, status), r.text
    if status == 404:
        assert r.json()["error"]["param"] == "model"
    _still_serving(http)


def test_model_names(http: httpx.Client) -> None:
    path = http.get("/get_model_info").json()["model_path"]
    for name in (MODEL, path):
        assert http.post("/v1/completions", json={**COMP, "model": name}).status_code == 200
        assert http.get(f"/v1/models/{name}").json()["id"] == MODEL
    _error(http.get("/v1/models/other"), 404)


def test_404_405_shape(http: httpx.Client) -> None:
    assert "/v2/nothing" in _error(http.get("/v2/nothing"), 404)
    assert "DELETE" in _error(http.delete("/v1/completions"), 405)
    assert "GET" in _error(http.get("/generate"), 405)


# --- implemented instead of ignored
# ----------------------------------------------------------------


def test_n_choices(client: openai.OpenAI, http: httpx.Client) -> None:
    kw = {"model": MODEL, "prompt": ["Hello", "Bye"], "max_tokens": 8, "n": 3, "seed": 7}
    a = client.completions.create(**kw)  # type: ignore[call-overload]
    b = client.completions.create(**kw)  # type: ignore[call-overload]
    assert [c.index for c in a.choices] == list(range(6))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices[:3]}) > 1  # choices differ
    assert a.usage is not None and a.usage.completion_tokens == 6 * 8
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        n=2,
        stream=True,
    )
    finished = {c.choices[0].index for c in chat if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    native = http.post("/generate", json=_gen(n=2, seed=1, max_new_tokens=3)).json()
    assert isinstance(native, list) and len(native) == 2
    assert all(r["meta_info"]["completion_tokens"] == 3 for r in native)


def test_logit_bias(client: openai.OpenAI, http: httpx.Client) -> None:
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = http.post("/generate", json={"text": "Hello", "sampling_params": greedy}).json()
    first = plain["output_ids"][0]
    forced = http.post(
        "/generate",
        json={"text": "Hello", "sampling_params": {**greedy, "logit_bias": {"65": 100}}},
    ).json()
    assert forced["output_ids"] == [65] * 6 != plain["output_ids"]
    banned = http.post(
        "/generate",
        json={"text": "Hello", "sampling_params": {**greedy, "logit_bias": {str(first): -100}}},
    ).json()
    assert first not in banned["output_ids"]
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logit_bias={"65": 100}
    )
    assert out.choices[0].text == forced["text"]


def test_echo_with_prompt_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = out.choices[0]
    assert choice.text.startswith("Hello there") and len(choice.text) > len("Hello there")
    lp = choice.logprobs
    assert lp is not None and out.usage is not None
    n_prompt, n_out = out.usage.prompt_tokens, out.usage.completion_tokens
    assert len(lp.tokens or []) == len(lp.token_logprobs or []) == n_prompt + n_out
    assert (lp.token_logprobs or [])[0] is None  # the first prompt token has no context
    assert all(isinstance(x, float) for x in (lp.token_logprobs or [])[1:])
    assert (lp.top_logprobs or [])[0] is None and len((lp.top_logprobs or [])[1]) >= 1
    scored = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=0, echo=True, logprobs=0
    )
    assert scored.choices[0].text == "Hello there"
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    assert (scored.choices[0].logprobs.token_logprobs or [])[1:] == (lp.token_logprobs or [])[
        1:n_prompt
    ]


def test_stop_reason(http: httpx.Client) -> None:
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text[3:5]
    assert stop
    by_string = http.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert by_string["finish_reason"] == "stop" and by_string["stop_reason"] == stop
    assert by_string["text"] == text[: text.index(stop)]
    by_token = http.post(
        "/v1/chat/completions",
        json={**CHAT, "max_tokens": 5, "stop_token_ids": [65], "logit_bias": {"65": 100}},
    ).json()
    choice = by_token["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == 65
    assert choice["matched_stop"] == 65
    length = http.post("/v1/completions", json=body).json()["choices"][0]
    assert length["finish_reason"] == "length" and length["stop_reason"] is None


if __name__ == "__main__":
    run_this_file(__file__)
