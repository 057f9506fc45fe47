"""``launch_server`` with expert parallelism or DP attention serves on CPU (gloo ranks, the
built-in tiny DeepSeek V4) and its greedy tokens for a batch of prompts of mixed lengths (one
chunked over two prefill steps) equal TP=1's:

- ``--tp-size 2 --ep-size 2`` and ``--tp-size 4 --ep-size 2``: experts expert-parallel with
  all-to-all; at TP=4 each expert is also TP-sliced over the two ranks that hold it;
- ``--tp-size 2 --dp-size 2 --enable-dp-attention``: each rank attends over its own DP group's
  requests (the four prompts balanced over the two groups, uneven lengths), tokens gathered
  around the MoE; then the long prompt alone over HTTP, the other group idle."""

from __future__ import annotations

import httpx
import pytest

from sglang import Engine
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file
from sglang.test.server_process import ServerProcess

register_cpu_ci(est_time=110)

PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
INPUTS = [list(range(5, 205)), [7], list(range(40, 57)), [3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def tp1() -> list[list[int]]:
    """TP=1's greedy tokens for INPUTS."""
    with Engine(device="cpu", random_seed=0, log_level="warning", chunked_prefill_size=128) as one:
        return [r["output_ids"] for r in one.generate(input_ids=INPUTS, sampling_params=PARAMS)]


def _serve(flags: tuple[str, ...], batches: list[list[list[int]]]) -> tuple[list, dict]:
    """Start a server with ``flags``, generate each batch in turn over HTTP; every batch's
    tokens and the server's args."""
    server = ServerProcess(
        "--device", "cpu", "--random-seed", "0", "--log-level", "warning",
        "--chunked-prefill-size", "128", *flags,
    )  # fmt: skip
    try:
        got = []
        for batch in batches:
            body = {"input_ids": batch, "sampling_params": PARAMS}
            r = httpx.post(f"{server.base_url}/generate", json=body, timeout=300)
            assert r.status_code == 200, r.text
            got.append([row["output_ids"] for row in r.json()])
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
    finally:
        server.stop()
    return got, info["server_args"]


@pytest.mark.parametrize(("tp", "ep"), [(2, 2), (4, 2)])
def test_ep_server_greedy_tokens_equal_tp1(tp1: list[list[int]], tp: int, ep: int) -> None:
    (got,), args = _serve(("--tp-size", str(tp), "--ep-size", str(ep)), [INPUTS])
    assert got == tp1
    assert (args["tp_size"], args["ep_size"], args["moe_a2a_backend"]) == (tp, ep, "ep")


def test_dp_attention_server_greedy_tokens_equal_tp1(tp1: list[list[int]]) -> None:
    flags = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")
    (got, (got_long,)), args = _serve(flags, [INPUTS, INPUTS[:1]])
    assert got == tp1
    assert got_long == tp1[0]  # one request: the other group runs its steps empty
    assert (args["tp_size"], args["dp_size"], args["enable_dp_attention"]) == (2, 2, True)
    assert args["moe_a2a_backend"] == "none"


if __name__ == "__main__":
    run_this_file(__file__)
