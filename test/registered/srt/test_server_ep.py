"""``launch_server --tp-size 2 --ep-size 2`` and ``--tp-size 4 --ep-size 2`` serve on CPU (gloo
ranks, the built-in tiny DeepSeek V4, experts expert-parallel with all-to-all; at TP=4 each
expert is also TP-sliced over the two ranks that hold it) and their greedy tokens for a batch of
prompts of mixed lengths (one chunked over two prefill steps) equal TP=1's."""

from __future__ import annotations

import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _server_testing import ServerProcess

from sglang import Engine
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=80)

PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
INPUTS = [list(range(5, 205)), [7], list(range(40, 57)), [3, 1, 4, 1, 5]]


@pytest.mark.parametrize(("tp", "ep"), [(2, 2), (4, 2)])
def test_ep_server_greedy_tokens_equal_tp1(tp: int, ep: int) -> None:
    flags = ("--device", "cpu", "--random-seed", "0", "--log-level", "warning")
    chunk = {"chunked_prefill_size": 128}
    with Engine(device="cpu", random_seed=0, log_level="warning", **chunk) as one:
        want = [r["output_ids"] for r in one.generate(input_ids=INPUTS, sampling_params=PARAMS)]
    server = ServerProcess(
        *flags, "--tp-size", str(tp), "--ep-size", str(ep), "--chunked-prefill-size", "128"
    )
    try:
        body = {"input_ids": INPUTS, "sampling_params": PARAMS}
        r = httpx.post(f"{server.base_url}/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        got = [row["output_ids"] for row in r.json()]
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
    finally:
        server.stop()
    assert got == want
    args = info["server_args"]
    assert (args["tp_size"], args["ep_size"], args["moe_a2a_backend"]) == (tp, ep, "ep")


if __name__ == "__main__":
    run_this_file(__file__)
