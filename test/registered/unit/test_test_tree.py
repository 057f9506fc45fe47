"""The test tree holds test files only: every module under ``test/`` is a test file
(``test_*.py``), ``conftest.py`` or ``__init__.py``; what tests share lives in the test kit
(``python/sglang/test``), where any test, benchmark or script imports it by its package name; and
every kit module is listed in ``docs/testing.md``'s table of the kit."""

from __future__ import annotations

from pathlib import Path

from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=1)

ROOT = Path(__file__).resolve().parents[3]
ALLOWED = ("conftest.py", "__init__.py")


def non_test_modules(test_dir: Path) -> list[str]:
    """Python files under ``test_dir`` that are neither test files nor pytest's own."""
    return sorted(
        p.relative_to(test_dir.parent).as_posix()
        for p in test_dir.rglob("*.py")
        if not p.name.startswith("test_") and p.name not in ALLOWED
    )


def test_only_test_modules_under_test() -> None:
    found = non_test_modules(ROOT / "test")
    assert not found, (
        f"modules under test/ that are not test files: {found}; move what tests share into the "
        "test kit (python/sglang/test) and import it from there"
    )


def test_the_check_sees_a_helper_module(tmp_path: Path) -> None:
    tests = tmp_path / "test"
    (tests / "registered" / "models").mkdir(parents=True)
    for name in ("test_a.py", "conftest.py", "__init__.py", "_helpers.py", "registered/b.py"):
        (tests / name).write_text("")
    (tests / "registered" / "models" / "test_b_gpu.py").write_text("")
    (tests / "registered" / "gpu_times.json").write_text("{}")
    assert non_test_modules(tests) == ["test/_helpers.py", "test/registered/b.py"]


def test_every_kit_module_is_in_the_testing_doc() -> None:
    kit = ROOT / "python" / "sglang" / "test"
    doc = (ROOT / "docs" / "testing.md").read_text()
    section = doc[doc.index("## The test kit") :]
    table = section[: section.find("\n## ", 1)]
    names = {p.stem for p in kit.glob("*.py") if p.name != "__init__.py"}
    names |= {p.name + "/" for p in kit.iterdir() if (p / "__init__.py").exists()}
    missing = sorted(n for n in names if f"`{n}`" not in table)
    assert not missing, f"test kit modules missing from docs/testing.md's kit table: {missing}"


if __name__ == "__main__":
    run_this_file(__file__)
