"""The server's life cycle on CPU, each case on its own server process (loopback only):

- ``--api-key``: 401 in OpenAI's shape without the key (every endpoint but /health), 200 with it;
- SIGTERM with streams in flight: a short stream finishes, new requests get 503, a long stream is
  ended after ``--shutdown-timeout`` with an error event and ``[DONE]``, the process exits 0 with
  no leaked-semaphore warning and no traceback;
- a scheduler rank killed (SIGKILL), follower or rank 0: the in-flight stream ends with an error
  event, and the server logs which rank died and exits non-zero within seconds;
- startup: a rank that fails gives one message, no traceback; a bad SGLANG_* value is named at
  once, with check_env's words.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.hang_guard import hang_guard
from sglang.test.run import run_this_file
from sglang.test.server_process import ServerProcess

register_cpu_ci(est_time=90)

LONG = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}


class _Stream(threading.Thread):
    """Reads one SSE stream in the background: its data lines, and how it ended."""

    def __init__(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None):
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers or {}
        self.lines: list[str] = []
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url, json=self.body, headers=self.headers, timeout=60
            ) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        self.first.set()
        except httpx.HTTPError as exc:
            self.error = exc
        self.first.set()

    def events(self) -> list[Any]:
        return [json.loads(x) for x in self.lines if x != "[DONE]"]


def test_api_key_then_graceful_sigterm() -> None:
    key = "s3cret-key"
    s = ServerProcess(
        "--device", "cpu", "--api-key", key, "--shutdown-timeout", "3", "--random-seed", "0"
    )
    auth = {"Authorization": f"Bearer {key}"}
    try:
        base = s.base_url
        assert httpx.get(base + "/health", timeout=10).status_code == 200  # open
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/generate"),
            ("GET", "/metrics"),
            ("GET", "/server_info"),
            ("POST", "/v1/chat/completions"),
        ):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                r = httpx.request(method, base + path, headers=headers, json={}, timeout=10)
                assert r.status_code == 401, (path, headers, r.text)
                assert "--api-key" in r.json()["error"]["message"]
                assert r.json()["error"]["type"] == "AuthenticationError"
        info = httpx.get(base + "/server_info", headers=auth, timeout=10).json()
        assert info["server_args"]["api_key"] == "<redacted>"
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        out = client.completions.create(
            model=info["model_info"]["model_path"], prompt="hi", max_tokens=2
        )
        assert out.usage is not None and out.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()

        long = _Stream(base + "/v1/completions", LONG, auth)
        short = _Stream(
            base + "/v1/completions", {**LONG, "max_tokens": 16, "prompt": "Hello"}, auth
        )
        long.start()
        assert long.first.wait(30) and long.error is None
        short.start()
        assert short.first.wait(30)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        late = httpx.post(
            base + "/v1/completions",
            headers=auth,
            timeout=10,
            json={"prompt": "hi", "max_tokens": 2},
        )
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
        assert httpx.get(base + "/health", timeout=10).status_code == 503
        short.join(30)
        assert short.lines[-1] == "[DONE]"
        assert short.events()[-1]["choices"][0]["finish_reason"] == "length"
        long.join(30)
        assert long.lines[-1] == "[DONE]", long.lines[-3:]
        err = long.events()[-1]["error"]
        assert "--shutdown-timeout" in err["message"] and err["code"] == 503
        rc = s.wait_exit(30)
        elapsed = time.monotonic() - t0
        logs = s.logs()
        assert rc == 0, logs
        # at least --shutdown-timeout; 4.5 s unloaded (docs/testing.md, timeouts)
        assert 2.5 < elapsed < hang_guard(5), elapsed
        assert "leaked" not in logs and "Traceback" not in logs, logs
    finally:
        s.stop()


@pytest.mark.parametrize(("tp", "victim"), [(2, 1), (1, 0)])
def test_killed_rank_stops_the_server(tp: int, victim: int) -> None:
    s = ServerProcess("--device", "cpu", "--tp-size", str(tp), "--random-seed", "0")
    try:
        base = s.base_url
        pids = httpx.get(base + "/server_info", timeout=10).json()["scheduler_pids"]
        assert len(pids) == tp
        stream = _Stream(base + "/v1/completions", LONG)
        stream.start()
        assert stream.first.wait(30) and stream.error is None
        t0 = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        rc = s.wait_exit(20)
        elapsed = time.monotonic() - t0
        logs = s.logs()
        assert rc not in (None, 0), logs
        assert elapsed < 15, elapsed
        assert f"scheduler rank {victim}" in logs and "SIGKILL" in logs, logs
        stream.join(10)
        # The stream was ended with an error event, not silently cut. (Rank 0 may see the broken
        # collective a moment before the watchdog sees the exit, so the words vary.)
        assert stream.lines and stream.lines[-1] == "[DONE]", (stream.lines[-3:], stream.error)
        assert stream.events()[-1]["error"]["code"] == 500
        for pid in pids:  # no rank left behind
            assert not _alive(pid), pid
    finally:
        s.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of an exited parent is reaped by init soon; treat it as gone
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _launch(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--device", "cpu", "--port", "1", *flags],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_failed_rank_startup_is_one_message() -> None:
    out = _launch("--tp-size", "3")  # the built-in model has 8 heads
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text, text
    assert text.count("failed to start") == 1, text
    assert "8 attention heads" in text and "ranks [0, 1, 2]" in text, text


@pytest.mark.parametrize("value", ["abc", "-3", "1.5"])
def test_bad_env_knob_rejected_at_launch(value: str) -> None:
    name = "SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS"
    t0 = time.monotonic()
    out = _launch(env={name: value})
    assert out.returncode == 2, out.stderr
    assert time.monotonic() - t0 < 60
    want = f"{name}={value!r} is invalid"
    assert want in out.stderr, out.stderr
    check = subprocess.run(
        [sys.executable, "-m", "sglang.check_env"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, name: value},
    )
    assert check.returncode == 1 and want in check.stdout


_NO_SHUTDOWN = """
from sglang import Engine
if __name__ == "__main__":
    e = Engine(device="cpu", log_level="warning")
    print("tokens", e.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"])
    keep = e  # never shut down: the interpreter's exit must still stop the ranks
"""


def test_engine_left_running_exits_cleanly(tmp_path: Any) -> None:
    """Ranks ignore SIGTERM (the launcher owns shutdown); an Engine the script never shut down
    must not hang multiprocessing's exit hook, which terminates and joins daemon children."""
    script = tmp_path / "no_shutdown.py"
    script.write_text(_NO_SHUTDOWN)
    out = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "tokens 2" in out.stdout
    assert "ERROR" not in out.stderr and "Traceback" not in out.stderr, out.stderr


if __name__ == "__main__":
    run_this_file(__file__)
