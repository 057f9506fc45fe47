"""The decode and prefill profile scripts still run against the current model and kernel APIs:
their ``--smoke`` mode builds tiny models on the CPU (the decode profile's kernels under the
Triton interpreter) and prints its tables. A script that stops at a ``TypeError`` after an API
change fails here instead of on the GPU machine, where its time is scarce."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=40)

ROOT = Path(__file__).resolve().parents[3]


def _run(script: str, *args: str) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT / "scripts")]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--smoke", *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_profile_decode_smoke() -> None:
    pytest.importorskip("triton")
    out = _run(
        "profile_decode.py", "--ratios", "4", "--batch", "2", "--context", "64", "--replays", "1"
    )
    for row in (
        "compressor proj + update",
        "= layer graph, kernels",
        "KDA conv + recurrent step",
        "MLA absorbed attention, batched",
        "AttnRes read",
        "= model static decode graph",
    ):
        assert row in out, row


def test_profile_prefill_smoke() -> None:
    out = _run("profile_prefill.py", "--host-trace")
    assert "prefill (GPU part of TTFT)" in out and "layers.0.attn" in out
    assert "host: CUDA runtime calls that can stall" in out


def test_profile_prefill_k3_smoke() -> None:
    out = _run("profile_prefill_k3.py", "--kda", "tf32x3,torch", "--repeats", "1")
    for row in ("KDA prefill tf32x3", "KDA prefill torch", "layers.1.self_attn:core"):
        assert row in out, row


if __name__ == "__main__":
    run_this_file(__file__)
