"""The ``deep_gemm`` MoE runner with the real DeepGEMM on the H200, at the real expert shapes.

DeepSeek V4 (E=256, top-6, H=4096, I=2048, clamped SwiGLU) and Kimi K3 latent experts (E=384,
top-16, H=3584, I=3072, SiTU), bf16 and FP8 (128x128 weight blocks), M from 1 to 8192, each
layout (masked up to 512 tokens, contiguous at every M, and the token-count choice). Fresh random
inputs with masked slots; outputs and the allocator poisoned with NaN. Up to 512 tokens the
reference is the torch runner; above, where the torch loop over dequantised experts would take
tens of GB, it is the Triton runner, itself checked against torch in test_fused_moe_gpu.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cuda_ci
from sglang.test.moe_model_cases import (
    SHAPES,
    expert_weights,
    poison_allocator,
    refill_and_replay,
    routing,
    tolerance,
)
from sglang.test.real_deep_gemm import deep_gemm_or_skip
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_norm_err

register_cuda_ci(est_time=160, suite="h200-1gpu")

M_VALUES = (1, 7, 64, 65, 512, 2048, 8192)
OWN_ACTIVATION = {"dsv4": ("swiglu", 1.0), "k3": ("situ", None)}


@pytest.fixture(scope="module")
def dg():  # type: ignore[no-untyped-def]
    return deep_gemm_or_skip()


def _reference(m: int, hidden, topk_w, topk_ids, weights, activation, limit):  # type: ignore[no-untyped-def]
    from sglang.kernels.ops.moe.fused_moe import fused_experts, fused_experts_torch

    fn = fused_experts_torch if m <= 512 else fused_experts
    return fn(
        hidden,
        topk_weights=topk_w,
        topk_ids=topk_ids,
        activation=activation,
        swiglu_limit=limit,
        **weights,
    )


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_deep_gemm_runner_matches_reference(dg, shape_name: str, fp8: bool, m: int) -> None:  # type: ignore[no-untyped-def]
    from sglang.srt.layers.moe.expert_weights import ExpertWeights
    from sglang.srt.layers.moe.moe_runner.base import MoERunConfig
    from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoERunner
    from sglang.srt.layers.moe.topk import TopKOutput

    shape = SHAPES[shape_name]
    raw = expert_weights(shape, fp8)
    activation, limit = OWN_ACTIVATION[shape_name]
    weights = ExpertWeights(raw["w13"], raw["w2"], raw.get("w13_scale"), raw.get("w2_scale"))
    hidden, topk_w, topk_ids = routing(m, shape, seed=m * 3 + fp8)
    want = _reference(m, hidden, topk_w, topk_ids, raw, activation, limit)
    assert torch.isfinite(want).all() and want.abs().sum() > 0
    layouts = ["contiguous", "auto"] + (["masked"] if m <= 512 else [])
    for layout in layouts:
        runner = DeepGemmMoERunner(MoERunConfig(activation, limit), deep_gemm=dg, layout=layout)  # type: ignore[arg-type]
        poison_allocator(
            m * shape.top_k * (shape.hidden + 2 * shape.inter) * 4 + (64 << 20), hidden.device
        )
        out = runner.run(hidden, TopKOutput(topk_w, topk_ids), weights)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"{layout}: unwritten or NaN rows"
        err = rel_norm_err(out, want)
        assert err < tolerance(fp8), (
            f"{shape_name} {'fp8' if fp8 else 'bf16'} M={m} {layout}: rel err {err:.3g}"
        )
        if m > 2:
            assert (out[m // 2] == 0).all(), f"{layout}: a fully masked token must be zero"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_masked_layout_replays_in_a_cuda_graph(dg, fp8: bool) -> None:  # type: ignore[no-untyped-def]
    from sglang.srt.layers.moe.expert_weights import ExpertWeights
    from sglang.srt.layers.moe.moe_runner.base import MoERunConfig
    from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoERunner
    from sglang.srt.layers.moe.topk import TopKOutput

    shape = SHAPES["dsv4"]
    raw = expert_weights(shape, fp8)
    weights = ExpertWeights(raw["w13"], raw["w2"], raw.get("w13_scale"), raw.get("w2_scale"))
    runner = DeepGemmMoERunner(MoERunConfig("swiglu", 1.0), deep_gemm=dg, layout="masked")
    hidden, topk_w, topk_ids = routing(16, shape, seed=5)
    topk = TopKOutput(topk_w, topk_ids)
    runner.run(hidden, topk, weights)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = runner.run(hidden, topk, weights)
    for seed in (6, 7):
        h2, w2, i2 = routing(16, shape, seed=seed)
        refill_and_replay(graph, (hidden, topk_w, topk_ids), (h2, w2, i2), out)
        eager = runner.run(h2, TopKOutput(w2, i2), weights)
        assert torch.isfinite(out).all() and rel_norm_err(out, eager) < 1e-6


if __name__ == "__main__":
    run_this_file(__file__)
