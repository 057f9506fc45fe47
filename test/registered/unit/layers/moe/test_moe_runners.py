"""MoE runners against the torch runner, and where each puts its final output (symmetric pool)."""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.moe.fused_moe import fused_experts_torch
from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8
from sglang.srt.distributed.symm_mem import output_scope
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner import (
    MOE_RUNNERS,
    MoERunConfig,
    create_moe_runner,
    deep_gemm,
    triton_runner,
)
from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoERunner, choose_layout
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.test.alloc_recorder import SymmetricScopeRecorder
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_deep_gemm import FakeDeepGemmGemms
from sglang.test.run import run_this_file

register_cpu_ci(est_time=20)

E, H, I, K = 6, 256, 256, 3


def _weights(fp8: bool, gen: torch.Generator) -> ExpertWeights:
    w13 = torch.randn(E, 2 * I, H, generator=gen) * 0.05
    w2 = torch.randn(E, H, I, generator=gen) * 0.05
    if not fp8:
        return ExpertWeights(w13.bfloat16(), w2.bfloat16())
    q13, s13 = block_quant_weight_fp8(w13, (128, 128))
    q2, s2 = block_quant_weight_fp8(w2, (128, 128))
    return ExpertWeights(q13, q2, s13, s2)


def _inputs(t: int, gen: torch.Generator, masked: bool = False) -> tuple[torch.Tensor, TopKOutput]:
    hidden = (torch.randn(t, H, generator=gen) * 0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)]).int()
    if masked and t:
        ids[0, 0] = -1  # an expert on another rank
    weights = torch.rand(t, K, generator=gen) + 0.1
    return hidden, TopKOutput(weights / weights.sum(-1, keepdim=True), ids)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


def test_registry_names_and_unknown_runner_error() -> None:
    assert set(MOE_RUNNERS.names()) >= {"torch", "triton", "deep_gemm"}
    with pytest.raises(ValueError, match="unknown MoE runner backend 'cutlass'.*torch"):
        create_moe_runner("cutlass", MoERunConfig())
    with pytest.raises(ValueError, match="unknown MoE activation 'gelu'"):
        MoERunConfig(activation="gelu")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t", [1, 5, 150])
@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("activation", ["swiglu", "situ"])
def test_deep_gemm_runner_matches_torch_runner(
    fp8: bool, t: int, layout: str, activation: str
) -> None:
    gen = torch.Generator().manual_seed(t * 7 + fp8)
    weights = _weights(fp8, gen)
    hidden, topk = _inputs(t, gen, masked=True)
    limit = 0.3 if activation == "swiglu" else None
    config = MoERunConfig(activation, limit)
    ref = create_moe_runner("torch", config).run(hidden, topk, weights)
    dg = FakeDeepGemmGemms()
    out = DeepGemmMoERunner(config, deep_gemm=dg, layout=layout).run(hidden, topk, weights)  # type: ignore[arg-type]
    # the 0.1.5.post1 names, resolved by capability
    name = f"m_grouped_{'fp8_fp4' if fp8 else 'bf16'}_gemm_nt_{layout}"
    assert [n for n, _ in dg.calls] == [name] * 2
    assert torch.isfinite(out.float()).all()
    assert _rel(out, ref) < (3e-2 if fp8 else 1e-2), _rel(out, ref)


def test_layout_by_token_count_and_never_contiguous_under_capture() -> None:
    for fp8 in (False, True):
        table = deep_gemm.LAYOUT_BY_TOKENS["fp8" if fp8 else "bf16"]
        small, large = 1, table[-1][0] + 1
        assert choose_layout(small, fp8, capturing=False) == table[0][1]
        assert choose_layout(large, fp8, capturing=False) == "contiguous"
        assert choose_layout(large, fp8, capturing=True) == "triton"


def test_layout_knob_forces_a_layout() -> None:
    from sglang.srt.environ import EnvValueError, envs

    with envs.SGLANG_DEEP_GEMM_MOE_LAYOUT.override("masked"):
        assert (
            DeepGemmMoERunner(MoERunConfig(), deep_gemm=FakeDeepGemmGemms()).layout_for(4096, True)
            == "masked"
        )
    with pytest.raises(EnvValueError, match="SGLANG_DEEP_GEMM_MOE_LAYOUT='strided'"):  # noqa: SIM117
        with envs.SGLANG_DEEP_GEMM_MOE_LAYOUT.override("strided"):
            pass


def test_missing_entry_point_is_named() -> None:
    class Old(FakeDeepGemmGemms):
        m_grouped_fp8_fp4_gemm_nt_masked = None  # type: ignore[assignment]
        fp8_m_grouped_gemm_nt_masked = None  # type: ignore[assignment]

    gen = torch.Generator().manual_seed(5)
    weights = _weights(True, gen)
    hidden, topk = _inputs(3, gen)
    runner = DeepGemmMoERunner(MoERunConfig(), deep_gemm=Old(), layout="masked")
    with pytest.raises(
        RuntimeError, match="no fp8_masked entry point.*m_grouped_fp8_fp4_gemm_nt_masked"
    ):
        runner.run(hidden, topk, weights)


def test_torch_runner_is_a_real_moe() -> None:
    """Cross-check the oracle itself against a per-token loop written here."""
    gen = torch.Generator().manual_seed(3)
    weights = _weights(False, gen)
    hidden, topk = _inputs(4, gen)
    out = create_moe_runner("torch", MoERunConfig("swiglu", None)).run(hidden, topk, weights)
    w13, w2 = weights.w13.double(), weights.w2.double()
    for t in range(4):
        acc = torch.zeros(H, dtype=torch.float64)
        for j in range(K):
            e = int(topk.topk_ids[t, j])
            gu = w13[e] @ hidden[t].double()
            act = torch.nn.functional.silu(gu[:I]) * gu[I:]
            acc += float(topk.topk_weights[t, j]) * (w2[e] @ act)
        assert _rel(out[t], acc) < 2e-2


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> SymmetricScopeRecorder:
    rec = SymmetricScopeRecorder()
    group = object()
    monkeypatch.setattr(output_scope, "use_symmetric_memory", rec)
    monkeypatch.setattr(output_scope, "is_allocation_symmetric", lambda: True)
    monkeypatch.setattr(output_scope, "get_tp_group_or_none", lambda: group)
    return rec


def _runner(name: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    config = MoERunConfig("swiglu", None)
    if name.startswith("deep_gemm"):
        layout = "contiguous" if name.endswith("contiguous") else "masked"
        return DeepGemmMoERunner(config, deep_gemm=FakeDeepGemmGemms(), layout=layout)
    if name == "triton":  # the kernel needs a GPU; its allocation contract is the runner's job
        monkeypatch.setattr(triton_runner, "_fused_experts", lambda: fused_experts_torch)
    return create_moe_runner(name, config)


@pytest.mark.parametrize("name", ["torch", "triton", "deep_gemm", "deep_gemm_contiguous"])
@pytest.mark.parametrize("t", [5, 150])
def test_only_the_final_output_is_allocated_in_the_pool(
    name: str, t: int, recorder: SymmetricScopeRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(11)
    weights = _weights(False, gen)
    hidden, topk = _inputs(t, gen)
    out = _runner(name, monkeypatch).run(hidden, topk, weights)
    assert recorder.entered and all(not disabled for _, disabled in recorder.entered)
    assert recorder.allocated == [out.untyped_storage().data_ptr()], (
        f"{name}: exactly the final output must be allocated in the pool scope"
    )


@pytest.mark.parametrize("name", ["torch", "triton", "deep_gemm", "deep_gemm_contiguous"])
def test_inplace_allocates_nothing_in_the_pool(
    name: str, recorder: SymmetricScopeRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(12)
    weights = _weights(False, gen)
    hidden, topk = _inputs(9, gen)
    expected = create_moe_runner("torch", MoERunConfig()).run(hidden.clone(), topk, weights)
    recorder.allocated.clear()
    recorder.entered.clear()
    out = _runner(name, monkeypatch).run(hidden, topk, weights, inplace=True)
    assert out.data_ptr() == hidden.data_ptr()
    assert recorder.allocated == []
    assert _rel(hidden, expected) < 1e-2


def test_asymmetric_allocation_bypasses_the_pool(
    recorder: SymmetricScopeRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(output_scope, "is_allocation_symmetric", lambda: False)
    gen = torch.Generator().manual_seed(13)
    hidden, topk = _inputs(4, gen)
    create_moe_runner("torch", MoERunConfig()).run(hidden, topk, _weights(False, gen))
    assert recorder.entered and all(disabled for _, disabled in recorder.entered)
    assert recorder.allocated == []


if __name__ == "__main__":
    run_this_file(__file__)
