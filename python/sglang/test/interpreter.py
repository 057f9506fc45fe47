"""Run a kernel check under the Triton interpreter on the CPU, in a subprocess: the interpreter is
chosen when Triton loads, so a test process that has imported the kernels cannot switch to it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


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


def run_interp_tests(file: str, flag: str, timeout: float = 300) -> None:
    """Rerun the ``interp_`` tests of the test file ``file`` under the interpreter, with the
    environment variable ``flag`` set to 1 so they know they are there (they skip elsewhere);
    fails unless they all ran and passed."""
    argv = ["-m", "pytest", file, "-q", "-k", "interp_", "-p", "no:cacheprovider"]
    out = run_under_interpreter(marker="passed", argv=argv, env={flag: "1"}, timeout=timeout)
    assert "skipped" not in out.splitlines()[-1], out[-4000:]
