"""The offline Engine on CPU with the paged static decode (SGLANG_STATIC_DECODE_WITHOUT_GRAPHS:
the CUDA-graph path run eagerly): startup sizes the pool by blocks, not whole contexts, and the
scheduler admits by free blocks end to end.

Context 1024 and --max-total-tokens 1024: whole-context slots would run 1 request; the paged
pool keeps --max-running-requests 8 and its 4 blocks of 256 tokens. Six greedy prompts sent at
once (one block each: four run, two wait for blocks) give the tokens each gives alone, and every
cache is freed at the end.
"""

from __future__ import annotations

import time

import pytest

from sglang import Engine
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=30)

PROMPTS = ["Hello, my name is", "The weather is", "One, two,", "a b c", "x" * 12, "1 2 3 4"]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def test_paged_engine_admits_by_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_STATIC_DECODE_WITHOUT_GRAPHS", "1")
    with Engine(
        device="cpu",
        random_seed=1,
        log_level="warning",
        context_length=1024,
        max_total_tokens=1024,
        max_running_requests=8,
    ) as e:
        info = e.get_server_info()["model_info"]
        assert "paged in 4 blocks of 256 tokens" in info["cuda_graph"], info["cuda_graph"]
        assert info["max_running_requests"] == 8 and info["max_total_tokens"] == 1024
        alone = [e.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
        together = [r["output_ids"] for r in e.generate(PROMPTS, GREEDY)]
        assert together == alone and all(len(ids) == 10 for ids in alone)
        deadline = time.monotonic() + 10
        while e.get_server_info()["scheduler"]["num_active_caches"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.get_server_info()["scheduler"]["num_active_caches"] == 0


if __name__ == "__main__":
    run_this_file(__file__)
