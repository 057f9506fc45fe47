"""The DSv4 indexer's length-aware top-k kernel (``kernels/ops/attention/indexer_topk.py``) picks
the set the torch path's stable descending sort keeps: each row's ``min(k, visible)`` best
entries, ties (many exact zeros, +0.0 and -0.0 mixed) to the earlier entry, zeros past them.
Fresh random scores with ``-inf`` past each row's visible count (never read: the rows also carry
NaN garbage there in a second check), visible counts 0, < k, = k, > k and the whole row, k = C.
Under the Triton interpreter on the CPU (a subprocess: it is chosen at import) and on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.interpreter import call_in_interpreter
from sglang.test.run import run_this_file

register_cpu_ci(est_time=15)
register_cuda_ci(est_time=15, suite="h200-1gpu")  # its @pytest.mark.gpu tests

Case = tuple[int, int, int]  # rows, columns, k
CPU_CASES: list[Case] = [(4, 64, 8), (5, 3000, 512), (3, 100, 100), (6, 2048, 512)]
GPU_CASES: list[Case] = CPU_CASES + [(64, 8192, 512), (16, 32768, 512), (1, 2048, 2048)]


def check_kernel(device: str) -> None:
    from sglang.kernels.ops.attention.indexer_topk import indexer_topk

    gen = torch.Generator().manual_seed(0)
    for bs, cols, k in CPU_CASES if device == "cpu" else GPU_CASES:
        scores = torch.randn(bs, cols, generator=gen)
        scores[scores < 0.3] = 0.0  # a third of the row ties at zero
        scores[0, ::3] = -0.0
        visible = torch.randint(0, cols + 1, (bs,), generator=gen)
        # the first rows cover every case: the whole row, < k, none, = k
        for row, count in enumerate((cols, min(k // 2, cols), 0 if bs > 3 else k, k)[:bs]):
            visible[row] = count
        for i in range(bs):
            scores[i, int(visible[i]) :] = float("-inf")
        want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        s_dev, v_dev = scores.to(device), visible.to(device)
        got = indexer_topk(s_dev, v_dev, k).cpu()
        # columns past `visible` are never read: garbage there changes nothing
        garbage = s_dev.clone()
        for i in range(bs):
            garbage[i, int(visible[i]) :] = float("nan")
        assert torch.equal(indexer_topk(garbage, v_dev, k).cpu(), got)
        for i in range(bs):
            n = min(k, int(visible[i]))
            assert sorted(got[i, :n].tolist()) == sorted(want[i, :n].tolist()), (bs, cols, k, i)
            assert bool((got[i, n:] == 0).all()), (bs, cols, k, i)
            if n:  # the strict winners in entry order, then the ties in entry order
                row = scores[i, : int(visible[i])]
                thr = row[want[i, n - 1]]
                above = torch.nonzero(row > thr).flatten().tolist()
                ties = torch.nonzero(row == thr).flatten().tolist()
                assert got[i, :n].tolist() == (above + ties)[:n], (bs, cols, k, i)


def test_kernel_matches_stable_sort_under_interpreter() -> None:
    call_in_interpreter(__file__, "check_kernel", "cpu")


def test_refuses_bad_arguments() -> None:
    from sglang.kernels.ops.attention.indexer_topk import indexer_topk

    with pytest.raises(ValueError, match="k=9"):
        indexer_topk(torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), 9)
    with pytest.raises(ValueError, match="fp32"):
        indexer_topk(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2), 4)


@pytest.mark.gpu
def test_kernel_matches_stable_sort_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check_kernel("cuda")


if __name__ == "__main__":
    run_this_file(__file__)
