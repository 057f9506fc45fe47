"""Run a registered test suite, or one time-balanced part of it, file by file with pytest.

The suites and their files come from the ``register_cpu_ci`` / ``register_cuda_ci`` calls of the
test files (``sglang.test.ci_register``, read without importing them). ``--part i/n`` cuts the
suite into ``n`` parts of about equal expected time (the measured time from the timing file
``test/registered/gpu_times.json`` where there is one, else the estimate), longest file first into
the lightest part, and runs part ``i``. Each file runs in its own pytest process under a hang
guard (5x its expected time + 2 minutes); GPU suites select the tests marked ``gpu`` /
``multi_gpu``, so a file that also holds CPU tests runs only its GPU ones there.

At the end it prints a markdown table: each file's status, passed / failed / skipped / error
counts and wall time, and the totals. ``--write-times`` merges the measured wall times into the
timing file (or the path given) for the files that finished.

Usage:
  python scripts/run_suite.py --suite h200-1gpu --part 1/4
  python scripts/run_suite.py --suite h200-1gpu --list --parts 4      # the parts, not run
  python scripts/run_suite.py --suite h200-1gpu --part 2/4 --write-times
  python scripts/run_suite.py --suite cpu -k mhc                     # pytest -k, per file
Exit status: 0 when every file passed (skips allowed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from sglang.test.ci_register import SUITES
from sglang.test.ci_suites import (
    TIMING_FILE,
    FileResult,
    SuiteFile,
    load_times,
    parse_part,
    partition,
    read_junit,
    save_times,
    suite_files,
    summary_table,
)


def run_file(f: SuiteFile, gpu: bool, extra: list[str]) -> FileResult:
    """One file in its own pytest process; its counts from the JUnit report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", f.path, "-q", "-rs", "-p", "no:cacheprovider"]
        cmd += [f"--junitxml={report}", *extra]
        if gpu:
            cmd += ["-m", "gpu or multi_gpu"]
        paths = [str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        print(
            f"== {f.path} (expected {f.expected:.0f} s, hang guard {f.hang_guard_s:.0f} s)",
            flush=True,
        )
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=f.hang_guard_s, check=False)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
        wall = time.monotonic() - started
        reported = report.is_file()
        counts = read_junit(report) if reported else (0, 0, 0, 0)
    passed, failed, skipped, errors = counts
    if code is None:
        status = "timeout"
    elif not reported and code not in (0, 5):
        status = "crashed"
    elif code in (0, 5) and not failed and not errors:  # 5: every test deselected
        status = "ok"
    else:
        status = "failed"
    return FileResult(f.path, passed, failed, skipped, errors, wall, status)


def choose_files(files: list[SuiteFile], wanted: list[str]) -> list[SuiteFile]:
    """The files whose path contains one of ``wanted``, in that order, each once."""
    missing = [w for w in wanted if not any(w in f.path for f in files)]
    if missing:
        raise ValueError(f"no file matches {', '.join(missing)}")
    chosen: list[SuiteFile] = []
    for w in wanted:
        chosen += [f for f in files if w in f.path and f not in chosen]
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", required=True, choices=sorted(SUITES))
    parser.add_argument("--part", default="1/1", help="i/n: run the i-th of n balanced parts")
    parser.add_argument("--list", action="store_true", help="print the parts and exit")
    parser.add_argument("--parts", type=int, default=None, help="with --list: how many parts")
    parser.add_argument(
        "--write-times",
        nargs="?",
        const=str(TIMING_FILE),
        default=None,
        help=f"merge the measured times into this file (default {TIMING_FILE})",
    )
    parser.add_argument("-k", default=None, help="pytest -k expression, passed to every file")
    parser.add_argument(
        "--files",
        nargs="+",
        default=None,
        help="instead of a part: the suite's files whose path contains one of these, in this order",
    )
    args = parser.parse_args()
    i, n = parse_part(args.part)
    times = load_times(ROOT)
    files = suite_files(ROOT, args.suite, times)
    if args.list:
        n = args.parts or n
        total = sum(f.expected for f in files)
        print(
            f"suite {args.suite}: {len(files)} files, {total:.0f} s expected; "
            f"{math.ceil(total / 480)} parts of <= 8 minutes"
        )
        for j, group in enumerate(partition(files, n), start=1):
            print(f"\npart {j}/{n}: {sum(f.expected for f in group):.0f} s")
            for f in group:
                src = "measured" if f.measured is not None else "estimate"
                print(f"  {f.path}  {f.expected:.0f} s ({src})")
        return 0
    if args.files:
        try:
            part = choose_files(files, args.files)
        except ValueError as e:
            parser.error(f"suite {args.suite}: {e}")
    else:
        part = partition(files, n)[i - 1]
    gpu = SUITES[args.suite].num_gpus > 0
    extra = ["-k", args.k] if args.k else []
    where = "chosen files" if args.files else f"part {i}/{n}"
    print(f"suite {args.suite}, {where}: {len(part)} files", flush=True)
    results = []
    for f in part:
        results.append(run_file(f, gpu, extra))
        r = results[-1]
        print(f"== {r.path}: {r.status} in {r.wall_s:.0f} s", flush=True)
    print("\n" + summary_table(results), flush=True)
    if args.write_times:
        # Starts from that file, else from the committed one: the result is a whole timing file.
        measured = load_times(ROOT, Path(args.write_times)) or load_times(ROOT)
        for r in results:
            if r.status in ("ok", "failed") and not args.k:
                measured.setdefault(args.suite, {})[r.path] = r.wall_s
        print(f"times written to {save_times(ROOT, measured, Path(args.write_times))}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
