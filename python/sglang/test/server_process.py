"""Start ``python -m sglang.launch_server`` as a subprocess on a free loopback port and wait until
it is healthy; the end-to-end server tests drive it over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from sglang.srt.distributed.parallel_state import find_free_port


class ServerProcess:
    def __init__(self, *flags: str, startup_timeout_s: float = 180.0) -> None:
        self.port = find_free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            "w+", prefix="sglang-server-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *flags,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not healthy after {startup_timeout_s}s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-5000:]

    def wait_exit(self, timeout_s: float) -> int | None:
        """The server's exit status once it exits on its own within ``timeout_s``; None while it
        still runs (the caller's ``stop`` ends it)."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        os.unlink(self.log.name)
