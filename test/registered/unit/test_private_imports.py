"""No private name crosses a package boundary: in ``python/sglang``, a ``from X import _y`` must
stay inside the folder that defines ``_y``. A private name is its folder's business; what
another package needs is public. Read from the source with ``ast`` (nothing is imported), every
import counted, also those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=2)

PYTHON_ROOT = Path(__file__).resolve().parents[3] / "python"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PYTHON_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _folder(dotted: str) -> str:
    """The folder (dotted) of a module or package of this tree: a package is its own folder."""
    return (
        dotted if (PYTHON_ROOT / Path(*dotted.split("."))).is_dir() else dotted.rpartition(".")[0]
    )


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    anchor = parts[: len(parts) - node.level + is_package]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def private_crossings(module: str, source: str, is_package: bool = False) -> list[str]:
    """``"module:line name"`` for each ``from X import _y`` of ``source`` whose ``X`` lives in
    another folder than ``module``."""
    own = module if is_package else module.rpartition(".")[0]
    bad: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = _resolve(module, is_package, node)
        if not base.startswith("sglang") or _folder(base) == own:
            continue
        bad += [
            f"{module}:{node.lineno} {base}.{alias.name}"
            for alias in node.names
            if _is_private(alias.name)
        ]
    return bad


def _violations() -> list[str]:
    bad: list[str] = []
    for path in sorted((PYTHON_ROOT / "sglang").rglob("*.py")):
        module = _module_name(path)
        bad += private_crossings(module, path.read_text(), path.name == "__init__.py")
    return bad


def test_the_scan_sees_the_tree() -> None:
    assert len(list((PYTHON_ROOT / "sglang").rglob("*.py"))) > 100


def test_the_scan_catches_each_kind_of_crossing() -> None:
    # A private name from another folder, absolute or relative, in a function too.
    src = (
        "from sglang.srt.layers.moe.sm_budget import _narrowed_num_sms\n"
        "from .sibling import _ok\n"
        "def f():\n"
        "    from ..utils.log import _said, get_logger\n"
        "from sglang.srt.utils.log import get_logger\n"
    )
    found = private_crossings("sglang.srt.models.some_model", src)
    assert found == [
        "sglang.srt.models.some_model:1 sglang.srt.layers.moe.sm_budget._narrowed_num_sms",
        "sglang.srt.models.some_model:4 sglang.srt.utils.log._said",
    ], found
    # Inside one folder a private name is the folder's own business.
    same = "from sglang.srt.layers.moe.sm_budget import _narrowed_num_sms\n"
    assert private_crossings("sglang.srt.layers.moe.mega_moe", same) == []


def test_no_private_name_crosses_a_package() -> None:
    assert _violations() == []


if __name__ == "__main__":
    run_this_file(__file__)
