"""The serving path on CUDA (run on the H200; skipped elsewhere): the built-in model in bf16 with
the triton MoE runner, greedy deterministic; the startup facts (MoE runner, SM budget, CUDA
graphs); decode CUDA graphs giving the greedy tokens of the same static decode run eagerly at the
same padded sizes (fp32, triton runner: equal by construction; 16-token prefill chunks keep the
fp32 MoE kernel in its smallest tiles, which fit shared memory). TP=2 over two GPUs:
``test_engine_tp2_gpu.py``."""

from __future__ import annotations

from typing import Any

import pytest

from sglang import Engine
from sglang.test.ci_register import register_cuda_ci
from sglang.test.engine_graph_check import (
    GRAPH_CHECK_ENGINE_ARGS,
    assert_same_tokens,
    serve_eager_static_then_graphs,
)
from sglang.test.run import run_this_file

register_cuda_ci(est_time=120, suite="h200-1gpu")

PROMPTS = ["Hello, my name is", "The weather is sunny in", "def main():"]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


def test_cuda_default_model() -> None:
    with Engine(device="cuda", random_seed=0, log_level="warning") as e:
        a = [r["output_ids"] for r in e.generate(PROMPTS, GREEDY)]
        b = [r["output_ids"] for r in e.generate(PROMPTS, GREEDY)]
        info = e.get_server_info()
    assert a == b and all(len(ids) == 16 for ids in a)
    model = info["model_info"]
    assert model["device"] == "cuda" and model["dtype"] == "bfloat16"
    assert model["moe_runner"] == "triton"
    assert model["mega_moe_sm_budget"] is None or model["mega_moe_sm_budget"] >= 2
    assert info["scheduler"]["num_active_caches"] == 0
    assert model["cuda_graph"].startswith("on (decode batch sizes 1, 2, 4, 8"), model["cuda_graph"]


def test_cuda_graph_greedy_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graph replay against the same static decode run eagerly at the same padded batch sizes
    (SGLANG_STATIC_DECODE_WITHOUT_GRAPHS): same kernels on the same shapes, so the tokens are equal
    by construction, not by luck. (The per-request eager decode computes the same maths with
    other shapes and summation orders, and fp32 Triton dots round their inputs to TF32, so its
    greedy tokens may part at a near-tie: prompt 2 did at output token 40; docs/parity.md.)

    Each prompt runs alone, so its prefill chunks and decode batches do not depend on when the
    requests reach the scheduler. 136 new tokens take every prompt past the 32-token window
    (the ring wraps), many ratio-4 blocks, the indexer's top-8 starting to choose (36 entries
    visible at position 35) and the first ratio-128 block."""
    common = GRAPH_CHECK_ENGINE_ARGS
    prompts = PROMPTS + ["x" * 40, "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18"]
    params = {**GREEDY, "max_new_tokens": 136}
    batched: list[Any] = []

    def run(engine: Any) -> list[list[int]]:
        singles = [engine.generate(p, params)["output_ids"] for p in prompts]
        # padded 5 -> 8 rows, sizes change as they end
        batched[:] = engine.generate(prompts, params)
        return singles

    want, got, _, on = serve_eager_static_then_graphs(common, run, monkeypatch)
    assert on.startswith("on (decode batch sizes 1, 2, 4, 8;"), on
    assert_same_tokens(got, want)
    assert [len(r["output_ids"]) for r in batched] == [136] * len(prompts)


def test_torch_runner_says_why_graphs_are_off() -> None:
    with Engine(device="cuda", moe_runner_backend="torch", log_level="warning") as e:
        cuda_graph = e.get_server_info()["model_info"]["cuda_graph"]
    assert cuda_graph.startswith("off (the torch MoE runner syncs"), cuda_graph


if __name__ == "__main__":
    run_this_file(__file__)
