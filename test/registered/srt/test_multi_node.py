"""Two "nodes" on one machine: two ``launch_server`` processes over loopback (gloo on CPU), each
running one of the two TP ranks, node 0 serving HTTP.

- they serve the greedy tokens of TP=1, and every rank samples with node 0's seed (each node is
  given its own ``--random-seed``; node 1's rank logs the one it uses);
- node 1 killed mid-request: the request fails with a JSON 500 naming the lost contact, and
  node 0 exits non-zero within seconds;
- node 1 never started: node 0 fails to start within the join timeout, saying who is missing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from sglang import Engine
from sglang.srt.distributed.parallel_state import find_free_port
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file
from sglang.test.server_process import ServerProcess

register_cpu_ci(est_time=45)

PROMPTS = ["Hello, my name is", "def main():"]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


# Each node resolves its own seed; node 0's must win on every rank.
SEEDS = {0: 11, 1: 22}


def _node_flags(addr: str, node_rank: int) -> list[str]:
    return [
        "--device",
        "cpu",
        "--tp-size",
        "2",
        "--random-seed",
        str(SEEDS[node_rank]),
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--dist-init-addr",
        addr,
    ]


def _start_node1(addr: str) -> subprocess.Popen[str]:
    # A session of its own: killing the group takes its launcher and its rank down together,
    # like a node that loses power.
    return subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", *_node_flags(addr, 1)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_two_nodes_serve_tp1_tokens_and_report_a_lost_node() -> None:
    with Engine(device="cpu", random_seed=0, log_level="warning") as one:
        want = [r["output_ids"] for r in one.generate(PROMPTS, GREEDY)]
    addr = f"127.0.0.1:{find_free_port()}"
    node1 = _start_node1(addr)
    node0 = None
    try:
        node0 = ServerProcess(*_node_flags(addr, 0))
        base = node0.base_url
        got = [
            httpx.post(
                base + "/generate",
                json={"text": p, "sampling_params": GREEDY},
                timeout=60,
            ).json()["output_ids"]
            for p in PROMPTS
        ]
        assert got == want
        info = httpx.get(base + "/get_server_info", timeout=30).json()
        assert info["server_args"]["random_seed"] == SEEDS[0]
        long_body = {"text": "x", "sampling_params": {**GREEDY, "max_new_tokens": 3000}}
        result: dict[str, httpx.Response] = {}
        req = threading.Thread(
            target=lambda: result.update(
                r=httpx.post(base + "/generate", json=long_body, timeout=60)
            )
        )
        req.start()
        time.sleep(1.0)  # the request is decoding on both nodes
        assert req.is_alive()
        t0 = time.monotonic()
        os.killpg(node1.pid, signal.SIGKILL)
        req.join(30)
        resp = result["r"]
        assert resp.status_code == 500, resp.text
        assert "lost contact" in resp.json()["error"]["message"], resp.text
        rc = node0.wait_exit(20)
        elapsed = time.monotonic() - t0
        logs = node0.logs()
        assert rc not in (None, 0), logs
        assert elapsed < 15, elapsed
        assert "lost contact with the other scheduler ranks" in logs, logs
    finally:
        if node0 is not None:
            node0.stop()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
        node1.wait(timeout=10)
    assert node1.stdout is not None
    node1_logs = node1.stdout.read()
    assert f"sampling seed {SEEDS[0]} (node 0's; this node resolved {SEEDS[1]})" in node1_logs, (
        node1_logs
    )


def test_node_that_never_joins_fails_node0_within_the_bound() -> None:
    addr = f"127.0.0.1:{find_free_port()}"
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--port", "1", *_node_flags(addr, 0)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SGLANG_DIST_JOIN_TIMEOUT_S": "3"},
    )
    elapsed = time.monotonic() - t0
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert elapsed < 60, elapsed
    assert "did not all join at --dist-init-addr" in text, text
    assert "1/2 clients joined" in text and "SGLANG_DIST_JOIN_TIMEOUT_S" in text, text


if __name__ == "__main__":
    run_this_file(__file__)
