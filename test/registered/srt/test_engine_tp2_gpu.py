"""The serving path on two GPUs of one host (run on the two-H200 runner; skipped elsewhere):
TP=2 over NCCL with symmetric memory gives TP=1's greedy tokens on the built-in model (fp32,
torch runner, so rounding cannot flip a token), and the same with CUDA graphs (triton runner)."""

from __future__ import annotations

from sglang import Engine
from sglang.test.ci_register import register_cuda_ci
from sglang.test.engine_graph_check import GRAPH_CHECK_ENGINE_ARGS
from sglang.test.run import run_this_file

register_cuda_ci(est_time=150, suite="h200-2gpu", num_gpus=2)

PROMPTS = ["Hello, my name is", "The weather is sunny in", "def main():"]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


def test_cuda_tp2_symm_mem_matches_tp1() -> None:
    common = {
        "device": "cuda",
        "dtype": "float32",
        "moe_runner_backend": "torch",
        "random_seed": 0,
        "log_level": "warning",
    }
    with Engine(**common) as one:
        want = [r["output_ids"] for r in one.generate(PROMPTS, GREEDY)]
    with Engine(**common, tp_size=2, enable_symm_mem=True) as two:
        got = [r["output_ids"] for r in two.generate(PROMPTS, GREEDY)]
        info = two.get_server_info()
    assert got == want
    assert info["model_info"]["symm_mem"] == "on"


def test_cuda_tp2_symm_mem_cuda_graphs_match_tp1() -> None:
    common = GRAPH_CHECK_ENGINE_ARGS
    with Engine(**common, disable_cuda_graph=True) as one:
        want = [r["output_ids"] for r in one.generate(PROMPTS, GREEDY)]
    with Engine(**common, tp_size=2, enable_symm_mem=True) as two:
        got = [r["output_ids"] for r in two.generate(PROMPTS, GREEDY)]
        info = two.get_server_info()["model_info"]
    assert info["cuda_graph"].startswith("on") and info["symm_mem"] == "on"
    assert got == want


if __name__ == "__main__":
    run_this_file(__file__)
