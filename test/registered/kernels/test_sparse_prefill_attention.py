"""DeepSeek V4's sparse prefill attention kernel on the CPU: the Triton kernel under the interpreter
(in a subprocess: the interpreter is switched on before triton is imported) against the torch
path it replaces, and the indexer's picks against the mask the torch path reads.

- Kernel vs ``dsv4_attention`` on random bf16 keys: window only, every complete block visible
  (ratio-128 style, here ratio 8) and indexed picks (ratio 4), later chunks (``q_first > 0``),
  fewer visible entries than k, heads that are not a multiple of the 16-row tile, window rows
  older than any query needs, an fp32 query (three bf16 parts). With three-part probabilities
  both sides are fp32 maths over exact products, so the bound is summation order: 1e-6. The
  default two parts keep 16 bits of each probability (relative rounding <= 2^-17): 2e-5. The
  one-part probability (8 bits) must miss 1e-6 by far, so the test can see the parts' rounding.
- The model (bf16, the default model's four layer kinds) prefilled in two chunks, the second a
  batch of that request and a fresh one: every layer's attention output with the kernel, on the
  layer inputs the torch path saw, against the torch path's (the default two parts: 2e-5).
- ``LightningIndexer.pick``: the first ``min(k, visible)`` picks are exactly the entries
  ``select`` marks (so the kernel attends what the torch path attends).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import run_under_interpreter
from sglang.test.run import run_this_file

register_cpu_ci(est_time=25)

TOL = 1e-6  # three-part probabilities: summation order only
TOL_DEFAULT = 2e-5  # the default two parts: each probability rounded to 16 bits


def test_picks_are_what_select_marks() -> None:
    from sglang.test.sparse_prefill_cases import scoring_indexer

    indexer = scoring_indexer(4, 16, 4, 6, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    n, num, q_first = 300, 80, 21  # 300 queries: two scoring chunks
    q = torch.randn(n, 4, 16, generator=g).bfloat16()
    w = torch.randn(n, 4, generator=g)
    keys = torch.randn(num, 16, generator=g).bfloat16()
    keys[5] = 0.0  # an entry that scores exactly 0 for every query: ties
    pos = torch.arange(q_first, q_first + n)
    mask = indexer.select(q, w, keys, pos)
    picks = indexer.pick(q, w, keys, pos)
    assert picks.shape == (n, 6)
    count = torch.clamp((pos + 1) // 4, max=6)
    assert int(count.min()) < 6  # some query sees fewer entries than k
    for i in range(n):
        marked = torch.zeros(num, dtype=torch.bool)
        marked[picks[i, : int(count[i])]] = True
        assert torch.equal(marked, mask[i]), i


def test_kernel_and_model_under_interpreter() -> None:
    run_under_interpreter(
        marker="SPARSE_PREFILL_OK",
        argv=[os.path.abspath(__file__), "--scenario"],
        env={"SGLANG_MHC_BACKEND": "torch"},
    )


def _kernel_cases() -> None:
    from sglang.test.sparse_prefill_cases import (
        PrefillCase,
        kernel_path,
        make_inputs,
        max_row_err,
        rel_err,
        torch_path,
    )

    cases = [
        PrefillCase(n=9, heads=4, dim=32, window=8, ratio=0, q_first=0),
        PrefillCase(n=12, heads=20, dim=32, window=8, ratio=0, q_first=30, extra_rows=5),
        PrefillCase(n=10, heads=4, dim=16, window=4, ratio=8, q_first=37),
        PrefillCase(n=14, heads=4, dim=32, window=8, ratio=4, q_first=0, topk=5),
        PrefillCase(n=11, heads=6, dim=32, window=8, ratio=4, q_first=25, topk=5),
        PrefillCase(n=8, heads=4, dim=32, window=8, ratio=4, q_first=17, topk=5, fp32_q=True),
    ]
    g = torch.Generator().manual_seed(0)
    for case in cases:
        x = make_inputs(case, "cpu", g)
        ref = torch_path(x)
        out = kernel_path(x, pv_parts=3, block_n=16)
        assert torch.isfinite(out).all(), case
        err = max_row_err(out, ref)
        default = max_row_err(kernel_path(x), ref)
        print(f"{case}: worst row err {err:.2e}, default (two parts) {default:.2e}")
        assert err < TOL and default < TOL_DEFAULT, (case, err, default)
    # The one-part probability keeps 8 bits: far past the bound (so the test sees the parts).
    x = make_inputs(cases[4], "cpu", g)
    one = rel_err(kernel_path(x, pv_parts=1, block_n=16), torch_path(x))
    print(f"pv_parts=1: {one:.2e}")
    assert one > 100 * TOL, one


def _model_layers() -> None:
    from sglang.test.sparse_prefill_cases import model_layer_errors

    errors = model_layer_errors("cpu", first=24, second=16, fresh=8)
    print("per layer call, max row err:", " ".join(f"{e:.2e}" for e in errors))
    assert len(errors) == 8 and max(errors) < TOL_DEFAULT, errors


if __name__ == "__main__":
    if "--scenario" in sys.argv:
        torch.set_num_threads(1)  # tiny tensors; the interpreter is the cost
        with torch.no_grad():
            t0 = time.perf_counter()
            _kernel_cases()
            t1 = time.perf_counter()
            _model_layers()
            print(f"kernel cases {t1 - t0:.1f} s, model {time.perf_counter() - t1:.1f} s")
        print("SPARSE_PREFILL_OK")
    else:
        run_this_file(__file__)
