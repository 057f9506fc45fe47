"""The serving path on CUDA (run on the H200; skipped elsewhere): the built-in model in bf16 with
the triton MoE runner, greedy deterministic; the startup facts (MoE runner, SM budget); and, with
two GPUs, TP=2 over NCCL with symmetric memory giving TP=1's greedy tokens (fp32, torch runner,
so rounding cannot flip a token)."""

from __future__ import annotations

import pytest
import torch
from sglang import Engine
from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file

register_cuda_ci(est_time=120)

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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_tp2_symm_mem_matches_tp1() -> None:
    common = {"device": "cuda", "dtype": "float32", "moe_runner_backend": "torch",
              "random_seed": 0, "log_level": "warning"}  # fmt: skip
    with Engine(**common) as one:
        want = [r["output_ids"] for r in one.generate(PROMPTS, GREEDY)]
    with Engine(**common, tp_size=2, enable_symm_mem=True) as two:
        got = [r["output_ids"] for r in two.generate(PROMPTS, GREEDY)]
        info = two.get_server_info()
    assert got == want
    assert info["model_info"]["symm_mem"] == "on"


if __name__ == "__main__":
    run_this_file(__file__)
