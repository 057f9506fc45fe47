"""``scripts/start_matrix.py``'s bookkeeping on CPU (the servers themselves start on the GPU):
the combinations and their parts, which refusal counts as naming a flag, and the graph == eager
verdict between twins."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file
from sglang.test.script_module import load_script

register_cpu_ci(est_time=3)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def sm() -> ModuleType:
    return load_script(ROOT / "scripts" / "start_matrix.py")


def test_combinations_and_parts(sm: ModuleType) -> None:
    allc = sm.combos(list(sm.MODELS), list(sm.FORMATS), list(sm.DTYPES), list(sm.RUNNERS),
                     list(sm.A2A), list(sm.GRAPHS))  # fmt: skip
    assert len(allc) == 2 * 2 * 3 * 3 * 3 * 2 == len(set(allc))
    for n in (1, 7, 10):
        parts = [sm.part_of(allc, i, n) for i in range(1, n + 1)]
        flat = [c for p in parts for c in p]
        assert sorted(flat, key=repr) == sorted(allc, key=repr)
        assert max(map(len, parts)) - min(map(len, parts)) <= 2
        for p in parts:  # twins run in the same part, one after the other
            assert all(p[k].twin == p[k + 1] for k in range(0, len(p), 2))
    c = allc[1]
    assert c.graphs == "off" and "--disable-cuda-graph" in c.flags()
    assert "--disable-cuda-graph" not in c.twin.flags()


def test_a_refusal_must_name_a_flag(sm: ModuleType) -> None:
    c = sm.Combo("dsv4", "tiny", "float32", "deep_gemm", "megamoe", "on")
    assert sm.names_a_flag("error: --moe-runner-backend deep_gemm cannot run on cpu", c)
    assert sm.names_a_flag("--moe-a2a-backend megamoe needs FP8 experts", c)
    assert not sm.names_a_flag("RuntimeError: CUDA out of memory", c)
    assert sm.names_a_flag("--max-total-tokens 8192 does not fit the GPU", c)  # a common flag
    assert not sm.names_a_flag("error: --tp-size 2 needs 2 GPUs", c)  # not this server's
    log = "loading\nTraceback ...\nValueError: --dtype float32 is not supported by x\n\n"
    assert sm.refusal_line(log) == "ValueError: --dtype float32 is not supported by x"
    assert sm.refusal_line("") == "(no output)"


def test_twins_compare_only_with_the_same_maths(sm: ModuleType) -> None:
    on = sm.Combo("k3", "tiny", "bfloat16", "triton", "none", "on")

    def served(c: object, graph: str, alone: list[int]) -> object:
        return sm.Outcome(c, "served", "16/16 requests", 1.0, graph, alone)

    eager = "off (disabled); static decode eager at the graph sizes"
    same = [
        served(on, "on (decode batch sizes 1, 2)", [1, 2, 3]),
        served(on.twin, eager, [1, 2, 3]),
    ]
    sm.compare_twins(same)
    assert all(o.ok and "graph == eager: yes" in o.detail for o in same)
    differ = [served(on, "on (x)", [1, 2, 3]), served(on.twin, eager, [1, 9, 3])]
    sm.compare_twins(differ)
    assert all(o.result == "FAIL" and "part at token 1" in o.detail for o in differ)
    other = [served(on, "off (the torch MoE runner syncs)", [1]), served(on.twin, "off (x)", [2])]
    sm.compare_twins(other)
    assert all(o.ok and "n/a" in o.detail for o in other)
    assert "| k3 | tiny | bfloat16 | triton | none | on | served |" in sm.table(other)


if __name__ == "__main__":
    run_this_file(__file__)
