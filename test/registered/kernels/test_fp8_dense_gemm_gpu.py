"""The block-FP8 dense GEMMs on the GPU (skipped elsewhere), at DeepSeek V4-Flash's dense shapes.

- Triton (plain and the grouped ``wo_a``) against the torch reference (both operands dequantised,
  one fp32 product) at M = 1 .. 2048: within one bf16 ulp plus 1e-3 of the largest value (the
  Hopper FP8 MMA accumulates a 128-long K block in reduced precision before the fp32 promotion,
  as DeepGEMM's does).
- DeepGEMM's ``fp8_gemm_nt`` (when usable) against the same reference and against Triton, and the
  fake DeepGEMM the CPU tests use against the real one.
- The quantising epilogue equals the unfused GEMM + quantiser bit for bit; the fused RMSNorm and
  activation quantisers equal their unfused chains (up to a rare rounding flip).
- CUDA-graph capture and replay of the FP8 layers (DeepGEMM, Triton with split-K, grouped, the
  fused producers) equals the eager run bit for bit on new inputs.
- Resident bytes of an FP8 linear on the GPU: the e4m3 weight plus its fp32 block scales.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cuda_ci
from sglang.test.real_deep_gemm import deep_gemm_or_skip
from sglang.test.run import run_this_file
from sglang.test.tolerance import bf16_mismatches

register_cuda_ci(est_time=150, suite="h200-1gpu")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# DeepSeek V4-Flash's dense GEMMs (N, K) a layer, one rank.
DSV4_SHAPES = {
    "wq_a": (1024, 4096),
    "wkv": (512, 4096),
    "wq_b": (32768, 1024),
    "indexer.wq_b": (8192, 1024),
    "wo_b": (4096, 8192),
    "shared.w1/w3": (2048, 4096),
    "shared.w2": (4096, 2048),
}
WO_A = (8, 1024, 4096)  # groups, rows a group, inputs a group
ROWS = (1, 16, 64, 256, 2048)


def _operands(m: int, n: int, k: int, seed: int, groups: int = 1):  # type: ignore[no-untyped-def]
    from sglang.kernels.ops.gemm.fp8_block_gemm import quant_activation_fp8
    from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8

    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (m, k) if groups == 1 else (m, groups, k)
    x = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    w = torch.randn(groups * n, k, device="cuda", generator=gen) * 0.02
    a_q, a_s = quant_activation_fp8(x)
    if groups > 1:
        a_q, a_s = a_q.view(m, groups, -1), a_s.view(m, groups, -1)
    return x, a_q, a_s, *block_quant_weight_fp8(w)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    bad = bf16_mismatches(got, want, fp32_tol=1e-3)
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} entries off"


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", sorted(DSV4_SHAPES))
def test_triton_gemm_matches_torch_at_dsv4_shapes(name: str, m: int) -> None:
    from sglang.kernels.ops.gemm.fp8_block_gemm import fp8_block_gemm, fp8_block_gemm_torch

    n, k = DSV4_SHAPES[name]
    _, a_q, a_s, w_q, w_s = _operands(m, n, k, seed=m + n)
    y = fp8_block_gemm(a_q, a_s, w_q, w_s)
    _assert_close(y, fp8_block_gemm_torch(a_q, a_s, w_q, w_s, torch.float32))


@pytest.mark.parametrize("m", (1, 64, 2048))
def test_triton_grouped_wo_a_matches_torch(m: int) -> None:
    from sglang.kernels.ops.gemm.fp8_block_gemm import fp8_grouped_gemm, fp8_grouped_gemm_torch

    groups, r, k = WO_A
    _, a_q, a_s, w_q, w_s = _operands(m, r, k, seed=m, groups=groups)
    y = fp8_grouped_gemm(a_q, a_s, w_q, w_s)
    assert y.shape == (m, groups * r)
    _assert_close(y, fp8_grouped_gemm_torch(a_q, a_s, w_q, w_s, torch.float32))


@pytest.fixture(scope="module")
def deep_gemm():  # type: ignore[no-untyped-def]
    return deep_gemm_or_skip()


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", sorted(DSV4_SHAPES))
def test_deep_gemm_matches_torch_and_triton(deep_gemm, name: str, m: int) -> None:  # type: ignore[no-untyped-def]
    from sglang.kernels.ops.gemm.fp8_block_gemm import fp8_block_gemm, fp8_block_gemm_torch
    from sglang.srt.layers.quantization.fp8_linear import Fp8Activation, deep_gemm_fp8_gemm

    n, k = DSV4_SHAPES[name]
    _, a_q, a_s, w_q, w_s = _operands(m, n, k, seed=3 * m + n)
    y = deep_gemm_fp8_gemm(deep_gemm, Fp8Activation(a_q, a_s), w_q, w_s, torch.bfloat16)
    _assert_close(y, fp8_block_gemm_torch(a_q, a_s, w_q, w_s, torch.float32))
    _assert_close(y, fp8_block_gemm(a_q, a_s, w_q, w_s).float())


def test_fake_deep_gemm_gemm_is_the_real_one(deep_gemm) -> None:  # type: ignore[no-untyped-def]
    from sglang.test.fake_deep_gemm import FakeDeepGemmGemms

    _, a_q, a_s, w_q, w_s = _operands(5, 256, 384, seed=9)
    real = torch.empty(5, 256, device="cuda", dtype=torch.bfloat16)
    deep_gemm.fp8_gemm_nt((a_q, a_s), (w_q, w_s), real)
    fake = torch.empty(5, 256, dtype=torch.bfloat16)
    cpu = FakeDeepGemmGemms(arch=90)
    cpu.fp8_gemm_nt((a_q.cpu(), a_s.cpu()), (w_q.cpu(), w_s.cpu()), fake)
    _assert_close(real.cpu(), fake.float())
    assert cpu.calls[-1][1]["sfa_copied"] is False


@pytest.mark.parametrize(("m", "groups"), [(1, 1), (64, 1), (2048, 1), (1, 8), (300, 8)])
def test_quantising_epilogue_equals_gemm_then_quantiser(m: int, groups: int) -> None:
    from sglang.kernels.ops.gemm.fp8_block_gemm import (
        fp8_block_gemm,
        fp8_gemm_quant_out,
        fp8_grouped_gemm,
    )
    from sglang.kernels.ops.gemm.fp8_gemm_config import choose_config
    from sglang.kernels.ops.quant.fp8 import per_token_group_quant_fp8

    n, k = (1024, 4096) if groups == 1 else WO_A[1:]
    _, a_q, a_s, w_q, w_s = _operands(m, n, k, seed=m, groups=groups)
    cfg = choose_config(m, n, k, groups=groups, quant_out=True)  # one tile: one sum order
    q, s = fp8_gemm_quant_out(a_q, a_s, w_q, w_s, config=cfg)
    gemm = fp8_grouped_gemm if groups > 1 else fp8_block_gemm
    want_q, want_s = per_token_group_quant_fp8(gemm(a_q, a_s, w_q, w_s, config=cfg), 128)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_fused_quantisers_equal_their_unfused_chains() -> None:
    from sglang.kernels.ops.quant.fp8 import per_token_group_quant_fp8
    from sglang.kernels.ops.quant.fused_quant import gated_act_quant_fp8, rms_norm_quant_fp8
    from sglang.srt.layers.activation import act_and_mul
    from sglang.srt.layers.layernorm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(4)
    x = (torch.randn(300, 1024, device="cuda", generator=gen) * 3).bfloat16()
    w = torch.rand(1024, device="cuda", generator=gen) + 0.5
    normed = torch.empty_like(x)
    q, s = rms_norm_quant_fp8(x, w, 1e-6, normed_out=normed)
    want = rms_norm(x, w, 1e-6)
    assert not bf16_mismatches(normed, want, fp32_tol=1e-6).any()
    chains = [((q, s), per_token_group_quant_fp8(want, 128))]
    parts = torch.randn(4, 300, 1024, device="cuda", generator=gen)
    chains.append(
        (
            rms_norm_quant_fp8(parts, w, 1e-6),
            per_token_group_quant_fp8(rms_norm(parts.sum(0).bfloat16(), w, 1e-6), 128),
        )
    )
    gate_up = (torch.randn(300, 4096, device="cuda", generator=gen) * 4).bfloat16()
    chains.append(
        (
            gated_act_quant_fp8(gate_up[:, :2048], gate_up[:, 2048:], "swiglu", 10.0),
            per_token_group_quant_fp8(act_and_mul(gate_up, "swiglu", swiglu_limit=10.0), 128),
        )
    )
    for (q, s), (want_q, want_s) in chains:
        # the same bf16 rows, but an fp32 sum (or sigmoid) in another order may round one
        # element of a row to the neighbouring bf16 value
        torch.testing.assert_close(s, want_s, rtol=1e-2, atol=0)
        assert (q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean() < 1e-3


def _fp8_layer(kind: str, seed: int):  # type: ignore[no-untyped-def]
    from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8
    from sglang.srt.layers.build_spec import LayerBuildSpec
    from sglang.srt.layers.linear import GroupedColumnParallelLinear, ReplicatedLinear
    from sglang.srt.layers.quantization.block_fp8 import BlockFp8Weight
    from sglang.srt.layers.quantization.dense_quant import FP8_BLOCK_QUANT

    spec = LayerBuildSpec(dtype=torch.bfloat16, device="cuda", dense_quant=FP8_BLOCK_QUANT)
    if kind == "grouped":
        groups, r, k = WO_A
        layer = GroupedColumnParallelLinear(k, groups, r, spec)
    else:
        n, k = DSV4_SHAPES["wq_a"]
        layer = ReplicatedLinear(k, n, spec)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(layer.out_features, layer.in_features, generator=gen) * 0.02
    layer.weight.weight_loader(layer.weight, BlockFp8Weight(*block_quant_weight_fp8(w)))
    return layer


@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize("path", ["deep_gemm", "triton", "grouped", "fused_norm"])
def test_cuda_graph_replay_equals_eager(path: str, m: int) -> None:
    from sglang.srt.environ import envs
    from sglang.srt.layers.quantization.fp8_linear import rms_norm_quant

    knob = "triton" if path == "triton" else "auto"
    layer = _fp8_layer("grouped" if path == "grouped" else "plain", seed=m)
    shape = (m, WO_A[0], WO_A[2]) if path == "grouped" else (m, layer.in_features)
    norm_w = torch.rand(layer.in_features, device="cuda") + 0.5

    def step(x: torch.Tensor) -> torch.Tensor:
        if path == "fused_norm":
            return layer(rms_norm_quant(x, norm_w, 1e-6))
        return layer(x)

    with envs.SGLANG_FP8_DENSE_GEMM.override(knob):
        x = torch.randn(shape, device="cuda").bfloat16()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile, then settle the allocator
                step(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(x)
        for seed in (1, 2):
            x.copy_(
                torch.randn(
                    shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)
                )
            )
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, step(x)), (path, m, seed)


def test_resident_bytes_are_fp8_weight_plus_scales() -> None:
    from sglang.srt.layers.build_spec import LayerBuildSpec
    from sglang.srt.layers.linear import ColumnParallelLinear
    from sglang.srt.layers.quantization.dense_quant import FP8_BLOCK_QUANT

    n, k = DSV4_SHAPES["shared.w1/w3"]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    spec = LayerBuildSpec(dtype=torch.bfloat16, device="cuda", dense_quant=FP8_BLOCK_QUANT)
    fp8 = ColumnParallelLinear(k, n, spec)
    fp8_bytes = torch.cuda.memory_allocated() - before
    assert fp8_bytes == n * k + 4 * (n // 128) * (k // 128)
    bf16 = ColumnParallelLinear(k, n, LayerBuildSpec(dtype=torch.bfloat16, device="cuda"))
    assert torch.cuda.memory_allocated() - before - fp8_bytes == 2 * n * k
    del fp8, bf16


if __name__ == "__main__":
    run_this_file(__file__)
