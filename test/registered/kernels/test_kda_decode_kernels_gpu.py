"""The KDA decode kernels (conv, recurrent step) on a GPU (skipped elsewhere): the checks of
``sglang.test.kda_decode_checks`` on CUDA tensors, plus the K3 shape (96 heads of 128) at batch 1
and 64 captured in a CUDA graph and replayed twice (the table is read from device memory)."""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.kda.recurrent_step import kda_recurrent_step_
from sglang.kernels.ops.pointer_table import int64_on_device
from sglang.srt.layers.attention.kda_gate import l2norm
from sglang.srt.layers.attention.kda_recurrent import kda_recurrent
from sglang.test import kda_decode_checks as checks
from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file

register_cuda_ci(est_time=15, suite="h200-1gpu")

pytestmark = pytest.mark.gpu


def test_recurrent_step() -> None:
    checks.check_recurrent_step("cuda")


def test_conv_decode() -> None:
    checks.check_conv_decode("cuda")


def test_layer_decode() -> None:
    checks.check_layer_decode("cuda")


def test_fallback_reasons() -> None:
    checks.check_fallback_reasons("cuda")


@pytest.mark.parametrize("batch", [1, 64])
def test_k3_shape_in_a_cuda_graph(batch: int) -> None:
    """Two replays of a captured step == two torch steps (K3: 96 heads of 128)."""
    gen = torch.Generator("cuda").manual_seed(batch)
    h, d, t = 96, 128, batch + 3
    x = checks._step_inputs(batch, t, h, d, d, torch.bfloat16, gen, "cuda")
    rows = torch.randperm(t, generator=gen, device="cuda")[:batch]
    states = [torch.randn(h, d, d, generator=gen, device="cuda") * 0.5 for _ in range(batch)]
    start = torch.stack(states)
    ptrs = int64_on_device([s.data_ptr() for s in states], torch.device("cuda"))
    out = torch.zeros(t, h, d, device="cuda")

    def step() -> None:
        kda_recurrent_step_(
            x["q"], x["k"], x["v"], x["g"], x["beta"], rows, ptrs, out,
            l2norm_eps=1e-6, q_scale=d**-0.5,
        )  # fmt: skip

    step()  # compile outside the capture, then put the states back
    for s, s0 in zip(states, start):
        s.copy_(s0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for s, s0 in zip(states, start):
        s.copy_(s0)  # the capture may have run the kernel
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    q, k = l2norm(x["q"]) * d**-0.5, l2norm(x["k"])
    one = [t_[:, None] for t_ in (q, k, x["v"].float(), x["g"][rows], x["beta"][rows])]
    want_o, s1 = kda_recurrent(*one, start)
    want_o, s2 = kda_recurrent(*one, s1)
    assert checks._rel_max(out[rows], want_o[:, 0]) < checks.STEP_TOL
    assert checks._rel_max(torch.stack(states), s2) < checks.STEP_TOL


if __name__ == "__main__":
    run_this_file(__file__)
