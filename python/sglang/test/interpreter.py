"""Run a kernel check under the Triton interpreter on the CPU, in a subprocess: the interpreter is
chosen when Triton loads, so a test process that has imported the kernels cannot switch to it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Set to 1 in the subprocess :func:`run_interp_tests` starts, so a test file knows it is there.
INTERP_TESTS_FLAG = "SGLANG_TEST_IN_TRITON_INTERPRETER"
IN_INTERPRETER = (
    os.environ.get(INTERP_TESTS_FLAG) == "1" and os.environ.get("TRITON_INTERPRET") == "1"
)
# The ``interp_`` tests: they run only in that subprocess (the driver test starts it).
interp_only = pytest.mark.skipif(not IN_INTERPRETER, reason="runs in the interpreter subprocess")


def run_under_interpreter(
    *,
    marker: str,
    code: str | None = None,
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> str:
    """``python -c code`` or ``python *argv`` with ``TRITON_INTERPRET=1`` (plus ``env``); fails
    the calling test unless it exits 0 and prints ``marker``. Skips where Triton is missing.
    Returns its stdout."""
    pytest.importorskip("triton")
    if code is not None and argv is None:
        command = [sys.executable, "-c", code]
    elif argv is not None and code is None:
        command = [sys.executable, *argv]
    else:
        raise ValueError("give exactly one of code= or argv=")
    proc = subprocess.run(
        command,
        check=False,
        env={**os.environ, "TRITON_INTERPRET": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and marker in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def call_in_interpreter(file: str, function: str, *args: object, timeout: float = 300) -> None:
    """Run ``function(*args)`` of the test file ``file`` (loaded by path, not as ``__main__``)
    under the interpreter; ``args`` must be literals (``repr`` round-trips them)."""
    call = ", ".join(repr(a) for a in args)
    code = (
        f"import runpy; ns = runpy.run_path({file!r}, run_name='interpreted'); "
        f"ns[{function!r}]({call}); print('INTERPRETED_OK')"
    )
    run_under_interpreter(marker="INTERPRETED_OK", code=code, timeout=timeout)


def run_interp_tests(file: str, timeout: float = 300) -> None:
    """Rerun the ``interp_`` tests of the test file ``file`` under the interpreter, with
    :data:`INTERP_TESTS_FLAG` set so they know they are there (:data:`interp_only` skips them
    elsewhere); fails unless they all ran and passed."""
    argv = ["-m", "pytest", file, "-q", "-k", "interp_", "-p", "no:cacheprovider"]
    env = {INTERP_TESTS_FLAG: "1"}
    out = run_under_interpreter(marker="passed", argv=argv, env=env, timeout=timeout)
    assert "skipped" not in out.splitlines()[-1], out[-4000:]
