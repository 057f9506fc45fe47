"""Kimi K3's AttnRes read kernel (``kernels/ops/layernorm/attn_res_read.py``) against the torch
read (``AttnResState.read_reference``) on fresh random rows: several bank depths (1 row: the
partial sum only, up to 11 rows: a padded row tile), hidden sizes off the 1024-wide block, rows
read through the strides of a wider buffer, bf16 and fp32. Under the Triton interpreter on the
CPU (a subprocess: the interpreter is chosen at import) and on a GPU where there is one.

The mix is rounded to the activation dtype before the out norm in both; only summation order
differs, so bf16 outputs agree to a couple of ulps (the interpreter rounds fp32 -> bf16 by
truncation, the GPU to nearest) and fp32 to ~1e-6.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.interpreter import call_in_interpreter
from sglang.test.run import run_this_file

register_cpu_ci(est_time=15)
register_cuda_ci(est_time=15, suite="h200-1gpu")  # its @pytest.mark.gpu tests

Case = tuple[int, int, int, torch.dtype]  # tokens, rows (bank + partial), hidden, dtype
CPU_CASES: list[Case] = [
    (3, 1, 64, torch.float32),
    (5, 2, 96, torch.float32),
    (2, 11, 1100, torch.float32),
    (4, 3, 200, torch.bfloat16),
    (1, 9, 2048, torch.bfloat16),
    (0, 2, 64, torch.float32),
]
GPU_CASES: list[Case] = CPU_CASES + [(64, 9, 7168, torch.bfloat16), (8192, 5, 7168, torch.bfloat16)]


def check_kernel(device: str) -> None:
    """Kernel == torch read on each case of ``device`` (imports here: the interpreter subprocess
    sets its environment before Triton loads)."""
    from sglang.kernels.ops.layernorm.attn_res_read import attn_res_read
    from sglang.srt.layers.attn_res import AttnResState
    from sglang.srt.layers.layernorm import RMSNorm

    gen = torch.Generator().manual_seed(0)
    for t, n_rows, h, dtype in CPU_CASES if device == "cpu" else GPU_CASES:
        rows = [(torch.randn(t, h, generator=gen) * (1 + i)).to(dtype) for i in range(n_rows)]
        norm = RMSNorm(h, 1e-6)
        norm.weight.data = torch.rand(h, generator=gen) + 0.5
        norm = norm.to(device)
        score = (torch.randn(h, generator=gen) * 0.2).to(device)
        state = AttnResState(rows[-1].to(device))
        state.bank = [r.to(device) for r in rows[:-1]]
        want = state.read_reference(score, 1e-5, norm)
        stacked = torch.stack([*state.bank, state.partial], dim=1)
        out = torch.full((t, h), float("nan"), dtype=dtype, device=device)
        got = attn_res_read(stacked, score, norm.weight, 1e-5, 1e-6, out)
        assert got.data_ptr() == out.data_ptr()
        bf16 = dtype == torch.bfloat16
        tol = {"atol": 3e-2, "rtol": 2e-2} if bf16 else {"atol": 5e-6, "rtol": 1e-5}
        torch.testing.assert_close(got.float(), want.float(), **tol)
        if t:  # rows read through the strides of a wider buffer, no copy
            wide = torch.randn(t, n_rows + 2, h, generator=gen).to(dtype).to(device)
            wide[:, 1 : n_rows + 1] = stacked
            view = wide[:, 1 : n_rows + 1]
            again = attn_res_read(view, score, norm.weight, 1e-5, 1e-6, torch.empty_like(out))
            assert torch.equal(again, got)


def test_kernel_matches_torch_under_interpreter() -> None:
    call_in_interpreter(__file__, "check_kernel", "cpu")


def test_cpu_read_stays_the_torch_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA or the interpreter the read never calls the kernel and is the torch read."""
    from sglang.srt.layers import attn_res

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    called: list[int] = []
    monkeypatch.setattr(attn_res, "attn_res_read", lambda *a: called.append(1))
    gen = torch.Generator().manual_seed(1)
    state = attn_res.AttnResState(torch.randn(2, 8, generator=gen))
    state.bank = [torch.randn(2, 8, generator=gen)]
    norm = attn_res.RMSNorm(8, 1e-6)
    score = torch.randn(8, generator=gen)
    got = state.read(score, 1e-5, norm)
    assert called == [] and torch.equal(got, state.read_reference(score, 1e-5, norm))


@pytest.mark.gpu
def test_kernel_matches_torch_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check_kernel("cuda")


if __name__ == "__main__":
    run_this_file(__file__)
