"""The offline Engine on the built-in model: greedy determinism (alone, batched, chunked),
stop conditions, log-probs consistent with a teacher-forced prefill, seeded sampling, request
validation, the token budget (queue, and reject what can never fit), and caches freed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from sglang import Engine
from sglang.srt.managers.tokenizer_manager import RequestError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=40)

PROMPTS = ["Hello, my name is", "The weather is sunny in", "One, two, three,"]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = Engine(device="cpu", random_seed=1, log_level="warning")
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def small_engine() -> Iterator[Engine]:
    e = Engine(
        device="cpu",
        random_seed=1,
        log_level="warning",
        max_total_tokens=300,
        chunked_prefill_size=16,
        max_running_requests=4,
        skip_tokenizer_init=True,
    )
    yield e
    e.shutdown()


def _active_caches(e: Engine) -> int:
    deadline = time.monotonic() + 10
    while True:
        n = int(e.get_server_info()["scheduler"]["num_active_caches"])
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def test_greedy_deterministic_and_batch_invariant(engine: Engine) -> None:
    alone = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    again = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    batched = [r["output_ids"] for r in engine.generate(PROMPTS, GREEDY)]
    assert alone == again == batched
    assert all(len(ids) == 12 for ids in alone)
    assert _active_caches(engine) == 0


def test_token_ids_prompt_equals_text_prompt(engine: Engine) -> None:
    tok = engine.tokenizer_manager.tokenizer
    assert tok is not None
    by_text = engine.generate(PROMPTS[0], GREEDY)
    by_ids = engine.generate(input_ids=tok.encode(PROMPTS[0]), sampling_params=GREEDY)
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["text"] == by_ids["text"]


def test_stop_token_and_stop_string(engine: Engine) -> None:
    full = engine.generate(PROMPTS[1], GREEDY)
    ids, text = full["output_ids"], full["text"]
    stop_id = ids[4]
    out = engine.generate(PROMPTS[1], {**GREEDY, "stop_token_ids": [stop_id]})
    assert out["output_ids"] == ids[: ids.index(stop_id) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    out = engine.generate(PROMPTS[1], {**GREEDY, "stop": [needle]})
    assert out["text"] == text[: text.index(needle)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": needle}
    assert _active_caches(engine) == 0


def test_logprobs_match_teacher_forcing(engine: Engine) -> None:
    tok = engine.tokenizer_manager.tokenizer
    assert tok is not None
    prompt = tok.encode(PROMPTS[2])
    out = engine.generate(
        input_ids=prompt,
        sampling_params=GREEDY,
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=0,
    )
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(top[0][1] == t for top, (_, t, _) in zip(meta["output_top_logprobs"], lps))
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(prompt) and inp[0][0] is None and all(x[0] < 0 for x in inp[1:])
    # Decoding through the cache must give what one prefill of prompt + output gives.
    forced = engine.generate(
        input_ids=prompt + out["output_ids"],
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=len(prompt),
    )
    assert forced["output_ids"] == [] and forced["meta_info"]["finish_reason"]["type"] == "length"
    teacher = [lp for lp, _, _ in forced["meta_info"]["input_token_logprobs"]]
    assert teacher == pytest.approx([lp for lp, _, _ in lps], abs=1e-3)


def test_seeded_sampling(engine: Engine) -> None:
    params = {"max_new_tokens": 10, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    a = engine.generate(PROMPTS[0], params)["output_ids"]
    b = engine.generate(PROMPTS[0], params)["output_ids"]
    c = engine.generate(PROMPTS[0], {**params, "seed": 99})["output_ids"]
    assert a == b and a != c


def test_streaming_and_abandoned_stream(engine: Engine) -> None:
    chunks = list(engine.generate(PROMPTS[0], GREEDY, stream=True))
    assert chunks[-1]["output_ids"] == engine.generate(PROMPTS[0], GREEDY)["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    stream = engine.generate(PROMPTS[0], {"max_new_tokens": 3000, "ignore_eos": True}, stream=True)
    next(stream)
    stream.close()  # abandon: the request is aborted and its cache freed
    assert _active_caches(engine) == 0


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"prompt": ""}, "empty"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [1, 10**6]}, "vocabulary"),
        ({"prompt": "x " * 5000}, "context length"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"prompt": "hi", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ],
)
def test_bad_requests(engine: Engine, kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(RequestError) as info:
        engine.generate(**kwargs)  # type: ignore[arg-type]
    assert needle in info.value.message
    assert engine.generate("ok", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_chunked_prefill_matches_whole_prefill(engine: Engine, small_engine: Engine) -> None:
    tok = engine.tokenizer_manager.tokenizer
    assert tok is not None
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 12)[:200]
    params = {**GREEDY, "max_new_tokens": 8}
    whole = engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    chunked = small_engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    assert whole == chunked


def test_budget_queues_and_rejects(small_engine: Engine) -> None:
    with pytest.raises(RequestError, match="--max-total-tokens"):
        small_engine.generate(input_ids=list(range(100)), sampling_params={"max_new_tokens": 250})
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    # 160 tokens each: one of the pool's two 256-token blocks each, so two run and one waits
    prompts = [list(range(i, i + 120)) for i in range(3)]
    together = small_engine.generate(input_ids=prompts, sampling_params=params)
    alone = [small_engine.generate(input_ids=p, sampling_params=params) for p in prompts]
    assert [r["output_ids"] for r in together] == [r["output_ids"] for r in alone]
    assert all(len(r["output_ids"]) == 40 for r in together)
    assert _active_caches(small_engine) == 0


def test_skip_tokenizer_init(small_engine: Engine) -> None:
    with pytest.raises(RequestError, match="--skip-tokenizer-init"):
        small_engine.generate("text needs a tokenizer", {"max_new_tokens": 2})
    out = small_engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})
    assert out["text"] == "" and len(out["output_ids"]) == 3


if __name__ == "__main__":
    run_this_file(__file__)
