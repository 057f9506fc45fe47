"""Tensor parallel over gloo on CPU: two scheduler ranks (rank 0 broadcasts every plan) produce
the same greedy tokens as one; a TP size the model cannot split fails at startup with the
model's reason."""

from __future__ import annotations

import pytest

from sglang import Engine
from sglang.srt.managers.launcher import EngineStartupError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=35)

PROMPTS = ["Hello, my name is", "Mountains, rivers, forests", "def main():"]


def test_tp2_matches_tp1() -> None:
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    tok_ids = list(range(5, 205))  # a 200-token prompt: chunked over two steps
    with Engine(device="cpu", random_seed=0, log_level="warning", chunked_prefill_size=128) as one:
        want = [r["output_ids"] for r in one.generate(PROMPTS, params)]
        want_long = one.generate(input_ids=tok_ids, sampling_params=params)["output_ids"]
    with Engine(
        device="cpu", tp_size=2, random_seed=0, log_level="warning", chunked_prefill_size=128
    ) as two:
        got = [r["output_ids"] for r in two.generate(PROMPTS, params)]
        got_long = two.generate(input_ids=tok_ids, sampling_params=params)["output_ids"]
        info = two.get_server_info()
    assert got == want and got_long == want_long
    assert info["server_args"]["tp_size"] == 2
    assert info["scheduler"]["num_active_caches"] == 0


def test_unsplittable_tp_fails_at_startup() -> None:
    with pytest.raises(EngineStartupError, match="over 3 ranks"):
        Engine(device="cpu", tp_size=3, log_level="error")


if __name__ == "__main__":
    run_this_file(__file__)
