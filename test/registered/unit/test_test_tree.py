"""The test tree holds test files only: every module under ``test/`` is a test file
(``test_*.py``), ``conftest.py`` or ``__init__.py``; what tests share lives in the test kit
(``python/sglang/test``), where any test, benchmark or script imports it by its package name; and
every kit module is listed in ``docs/testing.md``'s table of the kit. No file under ``test/`` or
``scripts/`` imports a test module (its imports are read with ``ast``, nested ones included), so
a helper two tests need is never reached through another test file."""

from __future__ import annotations

import ast
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


def imported_test_modules(root: Path) -> list[str]:
    """``path:line name`` for every import, in a file under ``root/test`` or ``root/scripts``, of
    a test module: one named after a ``test_*.py`` file under ``root/test``, anything under the
    ``test``/``registered`` packages, or a relative import from inside ``test/``."""
    tests = root / "test"
    test_names = {p.stem for p in tests.rglob("test_*.py")}
    found = []
    for path in sorted([*tests.rglob("*.py"), *(root / "scripts").rglob("*.py")]):
        where = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=where)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level and path.is_relative_to(tests):
                    found.append(f"{where}:{node.lineno} {'.' * node.level}{node.module or ''}")
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] in ("test", "registered") or any(p in test_names for p in parts):
                    found.append(f"{where}:{node.lineno} {name}")
    return found


def test_no_file_imports_a_test_module() -> None:
    found = imported_test_modules(ROOT)
    assert not found, (
        f"imports of test modules: {found}; move what they share into the test kit "
        "(python/sglang/test) and import it from there"
    )


def test_the_check_sees_an_imported_test_module(tmp_path: Path) -> None:
    kernels = tmp_path / "test" / "registered" / "kernels"
    kernels.mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (kernels / "test_a.py").write_text("import torch\nfrom sglang.test.tolerance import ulp\n")
    (kernels / "test_b.py").write_text(
        "import os\n\nfrom test_a import make_case\n\n\ndef f():\n    import test_a as t\n"
    )
    (kernels / "test_c.py").write_text("from registered.kernels.test_a import x\nfrom . import y\n")
    (tmp_path / "scripts" / "bench.py").write_text("import sys\nfrom test_a import make_case\n")
    (tmp_path / "scripts" / "test_map.py").write_text("import ast\n")
    assert imported_test_modules(tmp_path) == [
        "scripts/bench.py:2 test_a",
        "test/registered/kernels/test_b.py:3 test_a",
        "test/registered/kernels/test_b.py:7 test_a",
        "test/registered/kernels/test_c.py:1 registered.kernels.test_a",
        "test/registered/kernels/test_c.py:2 .",
    ]


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
