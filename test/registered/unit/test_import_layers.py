"""The import rules of the package, read from the source with ``ast`` (nothing is imported):
``kernels/`` imports nothing from ``srt/``, ``srt/layers/`` imports nothing from ``srt/models/``,
and every package imports only its own layer or the ones below it. Every import counts, also
those inside functions and under ``TYPE_CHECKING``: each one is an edge of the design."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=2)

PYTHON_ROOT = Path(__file__).resolve().parents[3] / "python"

# Top to bottom (docs/architecture.md). A package may import its own layer and any lower one.
LAYER_OF: dict[str, int] = {
    "sglang.srt.entrypoints": 8,
    "sglang.srt.managers": 7,
    "sglang.srt.model_executor": 6,
    "sglang.srt.models": 5,
    "sglang.srt.model_loader": 4,
    "sglang.srt.layers": 3,
    "sglang.kernels": 2,
    "sglang.srt.distributed": 1,
    "sglang.srt.utils": 0,
    "sglang.srt.sampling": 0,
    "sglang.srt.mem_cache": 0,
    "sglang.srt.chat": 0,
    "sglang.srt.parsers": 0,
    "sglang.srt.constrained": 0,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PYTHON_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_files(package: str) -> list[Path]:
    return sorted((PYTHON_ROOT / Path(*package.split("."))).rglob("*.py"))


def imported_names(module: str, source: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in ``source``; ``from a import b`` gives ``a.b``, so a
    submodule imported by name counts as itself."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if base else alias.name


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _layer(name: str) -> int | None:
    owners = [p for p in LAYER_OF if _under(name, p)]
    return LAYER_OF[max(owners, key=len)] if owners else None


def upward_imports(module: str, source: str, is_package: bool = False) -> list[str]:
    """``"module:line imports name"`` for each import of ``source`` that breaks a rule."""
    bad: list[str] = []
    own = _layer(module)
    for line, name in imported_names(module, source, is_package):
        target = _layer(name)
        kernels_into_srt = _under(module, "sglang.kernels") and _under(name, "sglang.srt")
        upward = own is not None and target is not None and target > own
        if kernels_into_srt or upward:
            bad.append(f"{module}:{line} imports {name}")
    return bad


def _violations(package: str, forbidden: str | None = None) -> list[str]:
    bad: list[str] = []
    for path in _package_files(package):
        module, is_package = _module_name(path), path.name == "__init__.py"
        source = path.read_text()
        if forbidden is None:
            bad += upward_imports(module, source, is_package)
        else:
            bad += [
                f"{module}:{line} imports {name}"
                for line, name in imported_names(module, source, is_package)
                if _under(name, forbidden)
            ]
    return bad


def test_the_tree_is_where_the_rules_expect_it() -> None:
    # An empty walk would pass every rule below.
    assert len(_package_files("sglang.kernels")) > 5
    assert len(_package_files("sglang.srt.layers")) > 20


def test_kernels_import_nothing_from_srt() -> None:
    assert _violations("sglang.kernels", forbidden="sglang.srt") == []


def test_layers_import_no_models() -> None:
    assert _violations("sglang.srt.layers", forbidden="sglang.srt.models") == []


@pytest.mark.parametrize("package", sorted(LAYER_OF))
def test_packages_import_only_their_layer_or_below(package: str) -> None:
    assert _violations(package) == []


@pytest.mark.parametrize(
    ("module", "source", "is_package", "want"),
    [
        ("sglang.kernels.ops.x", "from sglang.srt.environ import envs", False, 1),
        ("sglang.kernels.ops.x", "def f():\n    import sglang.srt.layers.mhc", False, 1),
        ("sglang.kernels.ops.x", "from sglang.srt import utils", False, 1),
        ("sglang.srt.layers.attention.a", "from ...models import cfg", False, 1),
        ("sglang.srt.layers", "from ..models.m import C", True, 1),
        ("sglang.srt.distributed.x", "from sglang.kernels.ops import y", False, 1),
        ("sglang.srt.layers.a", "from sglang.kernels.ops import y\nimport torch", False, 0),
        ("sglang.srt.models.m", "from sglang.srt.layers.mhc import mhc_pre", False, 0),
        ("sglang.srt.layers.a", "from sglang.srt.environ import envs", False, 0),
    ],
)
def test_the_checker_finds_upward_imports(
    module: str, source: str, is_package: bool, want: int
) -> None:
    assert len(upward_imports(module, source, is_package)) == want


if __name__ == "__main__":
    run_this_file(__file__)
