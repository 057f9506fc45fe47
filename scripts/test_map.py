"""Which test files import each module of ``python/sglang``: a static scan, nothing is imported.

Every ``import`` / ``from ... import`` statement of every test file (``test/**/test_*.py``,
statements inside functions included) is resolved to the modules it names: ``from sglang.a
import b`` names ``sglang.a.b`` when that is a module, else ``sglang.a``. Only direct imports
count: a test that reaches a module through the test kit or another module is not listed for it.

Usage:
  python scripts/test_map.py                                  # every module and its test files
  python scripts/test_map.py --module sglang.srt.mem_cache.radix_cache
  python scripts/test_map.py --module radix_cache             # a unique suffix is enough
  python scripts/test_map.py --module python/sglang/srt/mem_cache/radix_cache.py
  python scripts/test_map.py --untested                       # modules no test file imports
  python scripts/test_map.py --stats                          # counts only
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "python"
TEST_DIR = ROOT / "test"


def module_names(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Dotted name -> file of every module under ``package_dir/sglang`` (packages' ``__init__``
    files are not modules of their own here)."""
    out = {}
    for path in sorted((package_dir / "sglang").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(package_dir).with_suffix("")
        out[".".join(rel.parts)] = path
    return out


def test_files(test_dir: Path = TEST_DIR) -> list[Path]:
    return sorted(test_dir.rglob("test_*.py"))


def imported_names(path: Path) -> set[str]:
    """Every dotted name an import statement of ``path`` could mean: ``import a.b`` gives
    ``a.b``; ``from a import b, c`` gives ``a``, ``a.b`` and ``a.c`` (the caller keeps the ones
    that are modules)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports directly (``from pkg import mod``, with
    ``pkg`` a package, counts for ``pkg.mod`` only: packages are not in ``modules``)."""
    return imported_names(path) & modules


def test_map(root: Path = ROOT) -> dict[str, list[str]]:
    """Module -> the test files (paths relative to ``root``) that import it, sorted."""
    modules = module_names(root / "python")
    known = set(modules)
    by_module: dict[str, list[str]] = {m: [] for m in modules}
    for path in test_files(root / "test"):
        rel = path.relative_to(root).as_posix()
        for m in imported_modules(path, known):
            by_module[m].append(rel)
    return {m: sorted(files) for m, files in by_module.items()}


def same_named(root: Path = ROOT) -> dict[str, list[str]]:
    """Module -> the test files named after it (``test_<module>.py`` or ``test_<module>_gpu.py``,
    anywhere under ``test/``)."""
    by_stem: dict[str, list[str]] = {}
    for path in test_files(root / "test"):
        stem = path.stem.removeprefix("test_")
        rel = path.relative_to(root).as_posix()
        by_stem.setdefault(stem, []).append(rel)
        if stem.endswith("_gpu"):
            by_stem.setdefault(stem.removesuffix("_gpu"), []).append(rel)
    return {m: sorted(by_stem.get(m.rsplit(".", 1)[-1], [])) for m in module_names(root / "python")}


def resolve(query: str, modules: Iterable[str]) -> str:
    """A module named by its dotted name, its file path, or a unique dotted suffix."""
    names = sorted(modules)
    q = query.strip()
    if q.endswith(".py"):
        p = Path(q).resolve()
        try:
            q = ".".join(p.relative_to(PACKAGE_DIR).with_suffix("").parts)
        except ValueError:
            q = q.removesuffix(".py").replace("/", ".")
    if q in names:
        return q
    matches = [n for n in names if n.endswith("." + q)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise SystemExit(f"--module {query!r}: no module of python/sglang has that name")
    raise SystemExit(f"--module {query!r} is ambiguous: {', '.join(matches)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--module", help="one module: dotted name, file path or unique suffix")
    group.add_argument("--untested", action="store_true", help="modules no test file imports")
    group.add_argument("--stats", action="store_true", help="counts only")
    args = ap.parse_args(argv)

    mapping = test_map()
    if args.module:
        name = resolve(args.module, mapping)
        print(name)
        named = same_named()[name]
        for f in mapping[name]:
            print(f"  {f}{'  (named after it)' if f in named else ''}")
        if not mapping[name]:
            print("  (no test file imports it)")
        return 0
    if args.untested:
        for m, files in mapping.items():
            if not files:
                print(m)
        return 0
    if args.stats:
        named = same_named()
        print(f"modules: {len(mapping)}")
        print(f"with a test file named after them: {sum(bool(v) for v in named.values())}")
        print(f"imported by no test file: {sum(not v for v in mapping.values())}")
        return 0
    width = max(len(m) for m in mapping)
    for m, files in mapping.items():
        print(f"{m:<{width}}  {', '.join(files) if files else '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
