"""The registered suites as the runner sees them: which files a suite runs, its time-balanced
parts, the committed timing file, and one file's pytest result.

Everything here reads the registry statically (:func:`sglang.test.ci_register.read_registrations`)
and imports neither torch nor a test module; ``scripts/run_suite.py`` is the command line over it.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from sglang.test.ci_register import SUITES, Registration, read_registrations
from sglang.test.hang_guard import HANG_GUARD_FACTOR

# Measured wall times of the GPU suites' files, written by run_suite.py --write-times.
TIMING_FILE = Path("test") / "registered" / "gpu_times.json"
# A file's hang guard: HANG_GUARD_FACTOR times its expected time (estimate or measurement), plus
# the start-up of a pytest process on a loaded machine.
HANG_GUARD_EXTRA_S = 120.0


@dataclass(frozen=True)
class SuiteFile:
    path: str
    est_time: float  # the registered estimate
    measured: float | None  # the timing file's measurement, if any

    @property
    def expected(self) -> float:
        """What the partition balances by: the measurement when there is one."""
        return self.measured if self.measured is not None else self.est_time

    @property
    def hang_guard_s(self) -> float:
        return HANG_GUARD_FACTOR * max(self.est_time, self.expected) + HANG_GUARD_EXTRA_S


def load_times(root: Path, path: Path | None = None) -> dict[str, dict[str, float]]:
    """``{suite: {file: seconds}}`` from the timing file (empty when it does not exist)."""
    f = root / (path or TIMING_FILE)
    if not f.is_file():
        return {}
    data = json.loads(f.read_text())
    return {s: {k: float(v) for k, v in files.items()} for s, files in data["suites"].items()}


def save_times(root: Path, times: dict[str, dict[str, float]], path: Path | None = None) -> Path:
    f = root / (path or TIMING_FILE)
    data = {
        "about": (
            "Measured wall seconds per registered GPU test file and suite, written by "
            "scripts/run_suite.py --write-times on the suite's machine; the CPU registry check "
            "holds each register_cuda_ci est_time within 2x of these."
        ),
        "suites": {
            s: {k: round(v, 1) for k, v in sorted(files.items())}
            for s, files in sorted(times.items())
        },
    }
    f.write_text(json.dumps(data, indent=1) + "\n")
    return f


def suite_files(
    root: Path, suite: str, times: dict[str, dict[str, float]] | None = None
) -> list[SuiteFile]:
    """The files registered for ``suite``, sorted by path."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; known: {sorted(SUITES)}")
    measured = (times if times is not None else load_times(root)).get(suite, {})
    regs: list[Registration] = [r for r in read_registrations(root) if r.suite == suite]
    return [
        SuiteFile(r.path, r.est_time, measured.get(r.path))
        for r in sorted(regs, key=lambda r: r.path)
    ]


def partition(files: list[SuiteFile], parts: int) -> list[list[SuiteFile]]:
    """``files`` in ``parts`` groups of about equal expected time: the longest first, each to
    the group with the least so far (ties: the lower group; deterministic)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    groups: list[list[SuiteFile]] = [[] for _ in range(parts)]
    totals = [0.0] * parts
    for f in sorted(files, key=lambda f: (-f.expected, f.path)):
        i = min(range(parts), key=lambda j: (totals[j], j))
        groups[i].append(f)
        totals[i] += f.expected
    return [sorted(g, key=lambda f: f.path) for g in groups]


def parse_part(text: str) -> tuple[int, int]:
    """``"i/n"`` (1-based) -> (i, n)."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError as exc:
        raise ValueError(f"--part takes i/n (e.g. 2/4), got {text!r}") from exc
    if not 1 <= i <= n:
        raise ValueError(f"--part {text}: need 1 <= i <= n")
    return i, n


@dataclass(frozen=True)
class FileResult:
    path: str
    passed: int
    failed: int
    skipped: int
    errors: int
    wall_s: float
    status: str  # "ok", "failed", "timeout" or "crashed"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def read_junit(xml_path: Path) -> tuple[int, int, int, int]:
    """(passed, failed, skipped, errors) from a pytest JUnit XML report."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = failures = skipped = errors = 0
    for s in suites:
        tests += int(s.get("tests", 0))
        failures += int(s.get("failures", 0))
        skipped += int(s.get("skipped", 0))
        errors += int(s.get("errors", 0))
    return tests - failures - skipped - errors, failures, skipped, errors


def summary_table(results: list[FileResult]) -> str:
    """A markdown table of the run, one row a file, and the totals."""
    lines = [
        "| file | status | passed | failed | skipped | errors | wall s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.path} | {r.status} | {r.passed} | {r.failed} | {r.skipped} | {r.errors} | "
            f"{r.wall_s:.1f} |"
        )
    tot = [sum(getattr(r, k) for r in results) for k in ("passed", "failed", "skipped", "errors")]
    wall = sum(r.wall_s for r in results)
    bad = sum(not r.ok for r in results)
    lines.append(
        f"| **{len(results)} files, {bad} not ok** | | {tot[0]} | {tot[1]} | {tot[2]} | {tot[3]} "
        f"| {wall:.1f} |"
    )
    return "\n".join(lines)


def estimate_mismatches(
    root: Path, times: dict[str, dict[str, float]] | None = None, factor: float = 2.0
) -> tuple[list[str], list[str]]:
    """(registrations whose estimate is off its measurement by more than ``factor``, GPU
    registrations not measured yet)."""
    times = times if times is not None else load_times(root)
    off, unmeasured = [], []
    for r in read_registrations(root):
        if r.kind != "cuda":
            continue
        got = times.get(r.suite, {}).get(r.path)
        if got is None:
            unmeasured.append(f"{r.path} ({r.suite})")
        elif not (got / factor <= r.est_time <= got * factor):
            off.append(f"{r.path} ({r.suite}): est_time {r.est_time:g} s, measured {got:g} s")
    return off, unmeasured
