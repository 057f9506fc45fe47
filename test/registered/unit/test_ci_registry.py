"""The registered suites (``sglang.test.ci_register``, ``sglang.test.ci_suites``,
``scripts/run_suite.py``), on CPU.

- The registry: every test file registers; every file with GPU tests registers for a GPU suite
  exactly once; every suite is known and fits the GPUs asked for; each estimate is within 2x of
  the committed timing file's measurement (``test/registered/gpu_times.json``). Files not measured
  yet are listed in a warning, not failed, until the suite's machine writes their times.
- The module marks of CPU, GPU and mixed files, and the refusals of bad registrations.
- The parts: every file in exactly one, balanced within the longest file, deterministic.
- One file run the way the runner runs it: its counts from the JUnit report, and the table.
"""

from __future__ import annotations

import types
import warnings
from pathlib import Path

import pytest

from sglang.test import ci_register
from sglang.test.ci_register import (
    SUITES,
    has_gpu_tests,
    read_registrations,
    register_cpu_ci,
    registered_test_files,
    registrations_in,
)
from sglang.test.ci_suites import (
    SuiteFile,
    estimate_mismatches,
    load_times,
    parse_part,
    partition,
    suite_files,
    summary_table,
)
from sglang.test.run import run_this_file
from sglang.test.script_module import load_script

register_cpu_ci(est_time=8)

ROOT = Path(__file__).resolve().parents[3]


def test_every_test_file_registers_and_gpu_files_exactly_once() -> None:
    files = registered_test_files(ROOT)
    assert len(files) > 100
    unregistered, bad_gpu, doubled = [], [], []
    for path in files:
        regs = registrations_in(path, ROOT)
        rel = path.relative_to(ROOT).as_posix()
        if not regs:
            unregistered.append(rel)
        kinds = [r.kind for r in regs]
        if len(set(kinds)) != len(kinds):
            doubled.append(rel)
        if has_gpu_tests(path) and kinds.count("cuda") != 1:
            bad_gpu.append(rel)
    assert not unregistered, f"test files without register_*_ci: {unregistered}"
    assert not doubled, f"files registering one kind twice: {doubled}"
    assert not bad_gpu, f"files with GPU tests not registered for one GPU suite: {bad_gpu}"


def test_every_suite_is_known_and_fits_its_gpus() -> None:
    regs = read_registrations(ROOT)
    for r in regs:
        assert r.suite in SUITES, f"{r.path}:{r.line}: unknown suite {r.suite!r}"
        suite = SUITES[r.suite]
        if r.kind == "cpu":
            assert suite.num_gpus == 0, f"{r.path}: a CPU registration in GPU suite {r.suite}"
        else:
            assert 1 <= r.num_gpus <= suite.num_gpus, f"{r.path}: {r.num_gpus} GPUs in {r.suite}"
        assert r.est_time > 0
    assert {r.suite for r in regs if r.kind == "cuda"} >= {"h200-1gpu", "h200-2gpu", "b200-1gpu"}


def test_estimates_are_within_2x_of_the_measured_times() -> None:
    off, unmeasured = estimate_mismatches(ROOT)
    assert not off, "estimates off their measured times by more than 2x:\n" + "\n".join(off)
    if unmeasured:
        warnings.warn(
            f"{len(unmeasured)} GPU test files are not in test/registered/gpu_times.json yet "
            "(listed, not failed, until run_suite.py --write-times measures them): "
            + ", ".join(unmeasured),
            stacklevel=1,
        )


def test_the_estimate_check_fails_a_wrong_estimate(tmp_path: Path) -> None:
    reg = read_registrations(ROOT)
    cuda = next(r for r in reg if r.kind == "cuda")
    times = {cuda.suite: {cuda.path: cuda.est_time * 3}}
    off, unmeasured = estimate_mismatches(ROOT, times)
    assert any(cuda.path in o for o in off)
    assert f"{cuda.path} ({cuda.suite})" not in unmeasured
    times = {cuda.suite: {cuda.path: cuda.est_time * 1.9}}
    assert not any(cuda.path in o for o in estimate_mismatches(ROOT, times)[0])
    assert load_times(ROOT).keys() <= SUITES.keys()


def _module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = f"/tmp/{name}.py"
    return mod


def _register_in(mod: types.ModuleType, code: str) -> None:
    """Run registration calls as the module's own top-level code."""
    mod.__dict__.update(
        register_cpu_ci=ci_register.register_cpu_ci,
        register_cuda_ci=ci_register.register_cuda_ci,
    )
    exec(compile(code, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - fixed test snippets


def _mark_names(mod: types.ModuleType) -> list[str]:
    return sorted(m.name for m in mod.pytestmark)


def test_module_marks_of_cpu_gpu_and_mixed_files() -> None:
    cpu, gpu, two, mixed, mixed_rev = (_module(n) for n in ("c", "g", "t", "m", "r"))
    _register_in(cpu, "register_cpu_ci(est_time=3)")
    assert _mark_names(cpu) == ["cpu"]
    _register_in(gpu, 'register_cuda_ci(est_time=3, suite="h200-1gpu")')
    assert _mark_names(gpu) == ["gpu", "needs_gpus"]
    _register_in(two, "register_cuda_ci(est_time=3, num_gpus=2)")  # the 2-GPU suite by default
    assert _mark_names(two) == ["multi_gpu", "needs_gpus"]
    # both kinds, either order: the module stays a CPU module (its GPU tests mark themselves)
    assert ci_register.default_cuda_suite(1) == "h200-1gpu"
    assert ci_register.default_cuda_suite(2) == "h200-2gpu"
    assert ci_register.default_cuda_suite(4) == "h200-8gpu"
    _register_in(two, "")  # registrations stay as made
    assert _mark_names(two) == ["multi_gpu", "needs_gpus"]
    _register_in(mixed, "register_cpu_ci(est_time=3)\nregister_cuda_ci(est_time=3)")
    _register_in(mixed_rev, "register_cuda_ci(est_time=3)\nregister_cpu_ci(est_time=3)")
    assert _mark_names(mixed) == _mark_names(mixed_rev) == ["cpu"]


@pytest.mark.parametrize(
    "code,message",
    [
        ('register_cuda_ci(est_time=3, suite="gpu-1")', "unknown suite"),
        ('register_cuda_ci(est_time=3, suite="h200-1gpu", num_gpus=2)', "has 1 GPU"),
        ('register_cpu_ci(est_time=3, suite="h200-1gpu")', "is a GPU suite"),
        ("register_cpu_ci(est_time=0)", "est_time must be > 0"),
        ("register_cpu_ci(est_time=3)\nregister_cpu_ci(est_time=3)", "called twice"),
    ],
)
def test_bad_registrations_are_refused(code: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _register_in(_module("bad"), code)


def test_parts_are_balanced_and_cover_every_file_once() -> None:
    files = suite_files(ROOT, "h200-1gpu")
    assert files
    for n in (1, 2, 3, 4, 7):
        parts = partition(files, n)
        flat = [f.path for p in parts for f in p]
        assert sorted(flat) == sorted(f.path for f in files) and len(flat) == len(set(flat))
        totals = [sum(f.expected for f in p) for p in parts]
        assert max(totals) - min(totals) <= max(f.expected for f in files)
        assert partition(files, n) == parts
    fake = [SuiteFile(f"f{i}", t, None) for i, t in enumerate([10, 9, 8, 7, 6, 5, 4])]
    assert [sum(f.expected for f in p) for p in partition(fake, 2)] == [23.0, 26.0]
    with_measured = [SuiteFile("a", 10, 100.0), SuiteFile("b", 50, None)]
    assert [f.path for f in partition(with_measured, 2)[0]] == ["a"]  # the measurement counts
    assert parse_part("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "x", "1/2/3"):
        with pytest.raises(ValueError):
            parse_part(bad)
    with pytest.raises(ValueError, match="unknown suite"):
        suite_files(ROOT, "gpu-1")


def test_every_gpu_suite_has_a_workflow_job_on_its_runner() -> None:
    workflow = (ROOT / ".github" / "workflows" / "gpu.yml").read_text()
    for suite in (s for s in SUITES.values() if s.num_gpus):
        assert f"runs-on: [self-hosted, {suite.name}]" in workflow, suite.name
        assert f"--suite {suite.name}" in workflow, suite.name
    assert "bash .ci/run" in (ROOT / ".github" / "workflows" / "ci.yml").read_text()


def _run_suite_module() -> types.ModuleType:
    return load_script(ROOT / "scripts" / "run_suite.py")


def test_one_file_runs_and_is_counted(tmp_path: Path) -> None:
    target = tmp_path / "test_sample.py"
    target.write_text(
        "import pytest\n"
        "def test_a():\n    assert 1\n"
        "def test_b():\n    assert 2\n"
        "def test_c():\n    pytest.skip('no')\n"
        "def test_d():\n    assert 0\n"
    )
    run_suite = _run_suite_module()
    result = run_suite.run_file(SuiteFile(str(target), 5.0, None), False, [])
    assert (result.passed, result.failed, result.skipped, result.errors) == (2, 1, 1, 0)
    assert result.status == "failed" and not result.ok and result.wall_s > 0
    only_ok = run_suite.run_file(SuiteFile(str(target), 5.0, None), False, ["-k", "not test_d"])
    assert only_ok.status == "ok" and only_ok.passed == 2
    table = summary_table([result, only_ok])
    assert "| failed | 2 | 1 | 1 | 0 |" in table and "**2 files, 1 not ok**" in table


def test_chosen_files_keep_the_asked_order() -> None:
    run_suite = _run_suite_module()
    files = [SuiteFile(f"test/registered/k/test_{n}_gpu.py", 5.0, None) for n in ("a", "b", "ab")]
    chosen = run_suite.choose_files(files, ["test_b_", "ab", "test_a"])
    assert [f.path for f in chosen] == [files[1].path, files[2].path, files[0].path]
    with pytest.raises(ValueError, match="no file matches test_zz"):
        run_suite.choose_files(files, ["test_a", "test_zz"])


if __name__ == "__main__":
    run_this_file(__file__)
