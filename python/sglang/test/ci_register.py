"""Registration of test files into CI suites, in the style of SGLang's registered tests.

Each test file calls a marker at module level to say what hardware it needs, which suite runs
it and roughly how long it takes::

    register_cpu_ci(est_time=30)                                      # the CPU suite
    register_cuda_ci(est_time=120, suite="h200-1gpu")                 # one H200
    register_cuda_ci(est_time=300, suite="h200-2gpu", num_gpus=2)     # two H200s

At run time a marker only attaches pytest marks to the module (``conftest.py`` skips GPU files
on machines without the GPUs). A file may hold both CPU tests and GPU tests: it registers once
for each (its GPU tests then carry ``@pytest.mark.gpu`` themselves, and the GPU suite runs only
those). The suite runner (``scripts/run_suite.py``) and the registry check read the calls with
:func:`read_registrations`, which parses the file (``ast``) instead of importing it, so the
registry is known without importing torch or a single test module.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass(frozen=True)
class Suite:
    """A CI suite: the runner label its jobs ask for and the GPUs each of its machines has."""

    name: str
    num_gpus: int
    description: str


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite("cpu", 0, "any machine (the CPU job), Triton kernels under the interpreter"),
        Suite("h200-1gpu", 1, "one NVIDIA H200 (sm_90, 132 SMs)"),
        Suite("h200-2gpu", 2, "two NVIDIA H200s of one host (NCCL, symmetric memory)"),
        Suite("h200-8gpu", 8, "eight NVIDIA H200s of one host (TP/EP 8)"),
        Suite("b200-1gpu", 1, "one NVIDIA B200 (sm_100: DeepGEMM's SM100 kernels)"),
    )
}

_CPU, _CUDA = "register_cpu_ci", "register_cuda_ci"
_KEY = "__sglang_ci_registrations__"  # the calling module's registrations, kind -> mark


def _check(kind: str, est_time: float, suite: str, num_gpus: int) -> None:
    if suite not in SUITES:
        raise ValueError(f"{kind}: unknown suite {suite!r}; known: {sorted(SUITES)}")
    if not est_time > 0:
        raise ValueError(f"{kind}: est_time must be > 0 seconds, got {est_time!r}")
    want = SUITES[suite].num_gpus
    if kind == _CPU and want:
        raise ValueError(f"{kind}: suite {suite!r} is a GPU suite")
    if kind == _CUDA and not 1 <= num_gpus <= max(want, 1):
        raise ValueError(f"{kind}: suite {suite!r} has {want} GPU(s), the file asks for {num_gpus}")


def _register(kind: str, marks: list[pytest.MarkDecorator]) -> None:
    """Record ``kind`` in the calling test module and recompute its module-level marks: a file
    registered for the CPU too keeps its GPU marks on its GPU tests only."""
    frame = inspect.stack()[2].frame
    module = frame.f_globals
    registered: dict[str, list[pytest.MarkDecorator]] = module.setdefault(_KEY, {})
    if kind in registered:
        raise ValueError(f"{kind} is called twice in {module.get('__file__')}")
    registered[kind] = marks
    ours = {id(m) for ms in registered.values() for m in ms}
    existing = module.get("pytestmark", [])
    if not isinstance(existing, list):
        existing = [existing]
    keep = [m for m in existing if id(m) not in ours]
    added = list(registered.get(_CPU, []))
    if _CPU not in registered:
        added += registered.get(_CUDA, [])
    module["pytestmark"] = [*keep, *added]


def register_cpu_ci(est_time: float, suite: str = "cpu") -> None:
    """A test file that runs anywhere, CI included; ``est_time`` seconds on a 2-core machine."""
    _check(_CPU, est_time, suite, 0)
    _register(_CPU, [pytest.mark.cpu])


def default_cuda_suite(num_gpus: int) -> str:
    """The H200 suite of a file that names none: the smallest with ``num_gpus`` GPUs."""
    fits = [s for s in SUITES.values() if s.name.startswith("h200") and s.num_gpus >= num_gpus]
    return min(fits, key=lambda s: s.num_gpus).name if fits else "h200-8gpu"


def register_cuda_ci(est_time: float, suite: str | None = None, num_gpus: int = 1) -> None:
    """A test file (or, next to :func:`register_cpu_ci`, the GPU-marked tests of one) for the GPU
    suite ``suite`` (default: the H200 suite with ``num_gpus`` GPUs), needing ``num_gpus`` GPUs;
    ``est_time`` seconds on that suite's machine. Skipped where the GPUs are missing."""
    suite = suite or default_cuda_suite(num_gpus)
    _check(_CUDA, est_time, suite, num_gpus)
    gpu_mark = pytest.mark.gpu if num_gpus == 1 else pytest.mark.multi_gpu
    _register(_CUDA, [gpu_mark, pytest.mark.needs_gpus(num_gpus)])


# --- the static registry ---------------------------------------------------------------------


@dataclass(frozen=True)
class Registration:
    """One ``register_*_ci`` call found in a test file."""

    path: str  # relative to the repository root
    kind: str  # "cpu" or "cuda"
    suite: str
    est_time: float
    num_gpus: int
    line: int


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError as exc:
        raise ValueError(
            f"arguments of register_*_ci must be literals: {ast.unparse(node)}"
        ) from exc


def _calls(tree: ast.Module) -> list[ast.Call]:
    """Module-level ``register_cpu_ci(...)`` / ``register_cuda_ci(...)`` calls."""
    out = []
    for stmt in tree.body:
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id in (_CPU, _CUDA)
        ):
            out.append(call)
    return out


def registrations_in(path: Path, root: Path) -> list[Registration]:
    """The registrations a test file makes (parsed, not imported)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.resolve().relative_to(root.resolve()).as_posix()
    found = []
    for call in _calls(tree):
        name = call.func.id  # type: ignore[attr-defined]
        params = ["est_time", "suite", "num_gpus"]
        args: dict[str, Any] = {"suite": None, "num_gpus": 1}
        for i, a in enumerate(call.args):
            args[params[i]] = _literal(a)
        for kw in call.keywords:
            if kw.arg is not None:
                args[kw.arg] = _literal(kw.value)
        kind = "cpu" if name == _CPU else "cuda"
        num_gpus = 0 if kind == "cpu" else int(args["num_gpus"])
        if args["suite"] is None:
            args["suite"] = "cpu" if kind == "cpu" else default_cuda_suite(num_gpus)
        found.append(
            Registration(
                rel, kind, str(args["suite"]), float(args["est_time"]), num_gpus, call.lineno
            )
        )
    return found


def registered_test_files(root: Path) -> list[Path]:
    """Every test file under ``test/registered`` (``test_*.py``), sorted."""
    return sorted((root / "test" / "registered").rglob("test_*.py"))


def read_registrations(root: Path) -> list[Registration]:
    """Every registration of every test file under ``root/test/registered``."""
    out: list[Registration] = []
    for path in registered_test_files(root):
        out += registrations_in(path, root)
    return out


def has_gpu_tests(path: Path) -> bool:
    """Whether a test file holds GPU tests: named ``*_gpu.py``, registered for a GPU suite, or
    marking tests (or itself) ``pytest.mark.gpu`` / ``pytest.mark.multi_gpu`` (read from the
    syntax tree, so a mention in a string or comment does not count)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if path.stem.endswith("_gpu") or any(c.func.id == _CUDA for c in _calls(tree)):  # type: ignore[attr-defined]
        return True
    marks = ("pytest.mark.gpu", "pytest.mark.multi_gpu")
    return any(isinstance(n, ast.Attribute) and ast.unparse(n) in marks for n in ast.walk(tree))
