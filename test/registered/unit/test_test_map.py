"""``scripts/test_map.py``: the static scan that lists, for each module of ``python/sglang``, the
test files that import it; on a tree made up here and on the repository itself."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file
from sglang.test.script_module import load_script

register_cpu_ci(est_time=2)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def test_map() -> types.ModuleType:
    return load_script(ROOT / "scripts" / "test_map.py")


def _tree(root: Path) -> None:
    """A package with a subpackage, four modules, and three test files."""
    files = {
        "python/sglang/__init__.py": "",
        "python/sglang/util.py": "",
        "python/sglang/mem/__init__.py": "",
        "python/sglang/mem/cache.py": "",
        "python/sglang/mem/pool.py": "",
        "python/sglang/mem/unused.py": "",
        # a module imported from its package, a name imported from a module, a plain import
        "test/registered/test_cache.py": (
            "from sglang.mem import cache\nfrom sglang.util import helper\nimport os\n"
        ),
        # an import inside a function counts; one in a string does not
        "test/registered/unit/test_pool_gpu.py": (
            "'from sglang.mem import unused'\ndef test_x():\n    import sglang.mem.pool\n"
        ),
        # a package alone names no module
        "test/registered/test_pkg.py": "import sglang.mem\nfrom sglang import mem\n",
        "test/conftest.py": "from sglang.mem import unused\n",  # not a test file
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_each_module_maps_to_the_test_files_importing_it(
    test_map: types.ModuleType, tmp_path: Path
) -> None:
    _tree(tmp_path)
    assert test_map.test_map(tmp_path) == {
        "sglang.mem.cache": ["test/registered/test_cache.py"],
        "sglang.mem.pool": ["test/registered/unit/test_pool_gpu.py"],
        "sglang.mem.unused": [],
        "sglang.util": ["test/registered/test_cache.py"],
    }
    named = test_map.same_named(tmp_path)
    assert named["sglang.mem.cache"] == ["test/registered/test_cache.py"]
    assert named["sglang.mem.pool"] == ["test/registered/unit/test_pool_gpu.py"]
    assert named["sglang.util"] == []


def test_module_queries_resolve_or_name_the_problem(test_map: types.ModuleType) -> None:
    modules = ["sglang.a.cache", "sglang.b.cache", "sglang.a.pool"]
    assert test_map.resolve("sglang.a.pool", modules) == "sglang.a.pool"
    assert test_map.resolve("pool", modules) == "sglang.a.pool"
    assert test_map.resolve("b.cache", modules) == "sglang.b.cache"
    with pytest.raises(SystemExit, match="ambiguous: sglang.a.cache, sglang.b.cache"):
        test_map.resolve("cache", modules)
    with pytest.raises(SystemExit, match="no module"):
        test_map.resolve("nothing", modules)


def test_the_repository_map(test_map: types.ModuleType, capsys: pytest.CaptureFixture) -> None:
    mapping = test_map.test_map(ROOT)
    on_disk = [p for p in (ROOT / "python" / "sglang").rglob("*.py") if p.name != "__init__.py"]
    assert len(mapping) == len(on_disk)
    radix_tests = mapping["sglang.srt.mem_cache.radix_cache"]
    assert "test/registered/unit/mem_cache/test_radix_cache.py" in radix_tests
    assert test_map.main(["--module", "python/sglang/srt/mem_cache/radix_cache.py"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sglang.srt.mem_cache.radix_cache\n")
    assert "test_radix_cache.py  (named after it)" in out
    assert test_map.main(["--untested"]) == 0
    untested = capsys.readouterr().out.split()
    assert untested == [m for m, files in mapping.items() if not files]


if __name__ == "__main__":
    run_this_file(__file__)
