"""MXFP4 experts on the GPU, each path against the torch oracle on the dequantised MXFP4 weights:

- the MXFP4 -> FP8 128x128 conversion on the GPU is exact (dequantised values bit-equal) and
  byte-identical to the CPU's;
- DeepGEMM's SM90 ``fp8_mega_moe`` on the converted experts, laid out as the loader keeps them
  (the only copy), inside the reserved-SM window;
- the ``deep_gemm`` runner's grouped GEMMs (contiguous and masked layouts) on converted experts;
- the ``triton`` runner on packed MXFP4 experts (the W4A16 ``fused_experts_mxfp4`` where it is
  installed, else the experts read on use);
- the DeepGEMM names the Blackwell single copy relies on exist in the installed DeepGEMM.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang.test.ci_register import register_cuda_ci
from sglang.test.real_deep_gemm import deep_gemm_or_skip
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_norm_err

register_cuda_ci(est_time=90, suite="h200-1gpu")

H, I, E, K = 4096, 2048, 32, 6  # DeepSeek V4's expert widths, fewer experts
LIMIT = 10.0


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def dg(cuda: torch.device) -> Any:
    return deep_gemm_or_skip()


def _mxfp4(cuda: torch.device, seed: int, e: int = E) -> Any:
    """Random packed experts (scales spanning 7 binades: every FP8 block exact) on the GPU."""
    from sglang.srt.layers.moe.expert_weights import mxfp4_experts

    gen = torch.Generator(device=cuda).manual_seed(seed)

    def rand(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, device=cuda, generator=gen).to(torch.uint8)

    # scale 2^-7..2^-1 keeps 6 * scale * sqrt(K) activations in range
    return mxfp4_experts(
        rand(e, 2 * I, H // 2),
        rand(e, H, I // 2),
        rand(e, 2 * I, H // 32, lo=120, hi=127),
        rand(e, H, I // 32, lo=118, hi=125),
    )


def _routing(cuda: torch.device, t: int, seed: int, e: int = E) -> Any:
    from sglang.srt.layers.moe.topk import TopKOutput

    gen = torch.Generator(device=cuda).manual_seed(seed)
    ids = torch.stack([torch.randperm(e, device=cuda, generator=gen)[:K] for _ in range(t)])
    weights = torch.rand(t, K, device=cuda, generator=gen)
    x = (torch.randn(t, H, device=cuda, generator=gen) * 0.05).bfloat16()
    return x, TopKOutput(weights, ids.int())


def _oracle(x: torch.Tensor, topk: Any, w: Any) -> torch.Tensor:
    """The torch oracle on the dequantised MXFP4 experts (bf16, exact)."""
    from sglang.kernels.ops.moe.fused_moe import fused_experts_torch

    d13, d2 = w.dequantized(torch.bfloat16)
    return fused_experts_torch(
        x, d13, d2, topk.topk_weights, topk.topk_ids, activation="swiglu", swiglu_limit=LIMIT
    )


def _fp8_staged(x: torch.Tensor) -> torch.Tensor:
    from sglang.kernels.ops.quant.fp8 import per_token_group_quant_fp8

    q, scale = per_token_group_quant_fp8(x, 128)
    t = x.shape[0]
    return (q.float().view(t, -1, 128) * scale.unsqueeze(-1)).view(t, -1).bfloat16()


def _converted(w: Any) -> Any:
    from sglang.srt.layers.moe.expert_weights import ExpertWeights
    from sglang.srt.layers.quantization.mxfp4_to_fp8 import mxfp4_to_fp8_blocks

    q13, s13, a = mxfp4_to_fp8_blocks(w.w13, w.w13_scale)
    q2, s2, b = mxfp4_to_fp8_blocks(w.w2, w.w2_scale)
    assert a.inexact_blocks == b.inexact_blocks == 0
    return ExpertWeights(q13, q2, s13, s2)


def test_conversion_on_the_gpu_is_exact_and_equals_the_cpus(cuda: torch.device) -> None:
    from sglang.srt.layers.quantization.mxfp4_to_fp8 import mxfp4_to_fp8_blocks

    w = _mxfp4(cuda, 1, e=4)
    fp8 = _converted(w)
    for a, b in zip(fp8.dequantized(torch.float32), w.dequantized(torch.float32)):
        assert torch.equal(a, b)
    q, s, _ = mxfp4_to_fp8_blocks(w.w2.cpu(), w.w2_scale.cpu())
    assert torch.equal(q.view(torch.uint8), fp8.w2.cpu().view(torch.uint8))
    assert torch.equal(s, fp8.w2_scale.cpu())


def test_fp8_mega_moe_on_converted_experts_under_the_reserve(
    cuda: torch.device, dg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the SM90 MegaMoE needs a Hopper GPU")
    from contextlib import contextmanager

    from sglang.srt.layers.moe import mega_moe
    from sglang.srt.layers.moe.expert_weights import ExpertWeights
    from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
    from sglang.srt.model_loader.mega_moe_prep import deep_gemm_mega_weight_builder

    packed = _mxfp4(cuda, 2)
    fp8 = _converted(packed)
    raw = {"w13": fp8.w13, "w2": fp8.w2, "w13_scale": fp8.w13_scale, "w2_scale": fp8.w2_scale}
    single = ExpertWeights.from_mega(deep_gemm_mega_weight_builder(dg, 90)(0, raw))
    del raw, fp8
    layer = FusedMoE(
        FusedMoEConfig(E, H, I, K, "swiglu", LIMIT, runner="triton", a2a_backend="megamoe"),
        device=cuda,
    )
    layer.load_local_weights(single)
    assert layer.mega_weights is not None and layer.mega_weights[0][0] is single.w13
    narrowed: list[int | None] = []
    real = mega_moe._configure_mega_moe_deep_gemm_num_sms

    @contextmanager
    def spy(deep_gemm: Any, device: Any = None) -> Any:
        with real(deep_gemm, device) as value:
            narrowed.append(value)
            yield value

    monkeypatch.setattr(mega_moe, "_configure_mega_moe_deep_gemm_num_sms", spy)
    physical = torch.cuda.get_device_properties(cuda).multi_processor_count
    before = dg.get_num_sms()
    for t in (1, 64, 300):
        x, topk = _routing(cuda, t, seed=t)
        kernel = layer.mega_kernel_for(x)
        assert kernel is not None and kernel.backend == "deep_gemm", kernel
        with torch.no_grad():
            got = layer.forward_mega(x, topk, kernel)
        torch.cuda.synchronize()
        # the oracle fed the rows as the kernel stages them (FP8, a scale per 128 values)
        want = _oracle(_fp8_staged(x), topk, packed)
        err = rel_norm_err(got, want)
        # the kernel's FP8 intermediate against the oracle's bf16 one; a wrong layout is O(1)
        assert torch.isfinite(got).all() and err < 5e-2, (t, err)
    assert narrowed and all(n is not None and n < physical for n in narrowed), narrowed
    assert dg.get_num_sms() == before


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_deep_gemm_runner_on_converted_experts(cuda: torch.device, dg: Any, layout: str) -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts_torch
    from sglang.srt.layers.moe.moe_runner.base import MoERunConfig
    from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoERunner

    packed = _mxfp4(cuda, 3)
    fp8 = _converted(packed)
    runner = DeepGemmMoERunner(MoERunConfig("swiglu", LIMIT), layout=layout)  # type: ignore[arg-type]
    assert runner.unreadable_reason(fp8) is None and runner.unreadable_reason(packed) is not None
    x, topk = _routing(cuda, 512, seed=4)
    with torch.no_grad():
        got = runner.run(x, topk, fp8)
    torch.cuda.synchronize()
    w8a8 = fused_experts_torch(
        x, fp8.w13, fp8.w2, topk.topk_weights, topk.topk_ids, activation="swiglu",
        swiglu_limit=LIMIT, w13_scale=fp8.w13_scale, w2_scale=fp8.w2_scale,
        block_shape=(128, 128),
    )  # fmt: skip
    # the same W8A8 maths up to how DeepGEMM rounds its FP8 intermediate (a wrong layout is O(1))
    assert rel_norm_err(got, w8a8) < 3e-2
    # against the MXFP4 weights themselves: W8A8 activations against bf16 ones
    assert rel_norm_err(got, _oracle(x, topk, packed)) < 6e-2


def test_triton_runner_on_packed_mxfp4_experts(cuda: torch.device) -> None:
    from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig

    packed = _mxfp4(cuda, 5)
    layer = FusedMoE(FusedMoEConfig(E, H, I, K, "swiglu", LIMIT, runner="triton"), device=cuda)
    layer.load_local_weights(packed)
    assert layer.weights is not None and layer.weights.is_mxfp4  # no dequantised copy
    assert layer.capture_unsafe_reason is None  # the W4A16 kernel reads the packed bytes
    for t in (1, 8, 256):
        x, topk = _routing(cuda, t, seed=10 + t)
        with torch.no_grad():
            got = layer(x, topk)
        torch.cuda.synchronize()
        err = rel_norm_err(got, _oracle(x, topk, packed))
        assert torch.isfinite(got).all() and err < 2e-2, (t, err)  # bf16 activations both sides


def test_blackwell_single_copy_names_exist_in_deep_gemm(dg: Any) -> None:
    from sglang.srt.layers.deep_gemm_adapter import has_entry_point

    for capability in ("sm100_mega_moe", "mega_moe_buffer", "sm90_mega_moe_weights"):
        assert has_entry_point(dg, capability), capability
    assert callable(dg.transform_sf_into_required_layout)


if __name__ == "__main__":
    run_this_file(__file__)
