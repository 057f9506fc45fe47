"""Block-FP8 dense layers (``srt/layers/linear.py`` with ``spec.dense_quant``) on the CPU: what
they keep resident, how their loaders shard an FP8 weight and its scales over tensor-parallel
ranks (whole 128-blocks, or a refusal naming the tensor and the TP size), the format mismatches
they refuse, the fp32 mode's dequantisation, the W8A8 forward (the torch reference of the GPU's
maths), the grouped ``wo_a`` layer, the fused activation quantisers, and which GEMM backend a
shape gets on CUDA (DeepGEMM through the fake, with its scale layout, or Triton with the reason).
"""

from __future__ import annotations

import logging

import pytest
import torch

from sglang.kernels.ops.gemm.fp8_block_gemm import fp8_block_gemm_torch, fp8_grouped_gemm_torch
from sglang.kernels.ops.quant.fp8 import FP8_DTYPE, block_quant_weight_fp8
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    GroupedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.srt.layers.quantization import fp8_linear
from sglang.srt.layers.quantization.block_fp8 import BlockFp8Weight, WeightFormatError
from sglang.srt.layers.quantization.dense_quant import FP8_BLOCK_QUANT
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex, WeightLoadError
from sglang.srt.model_loader.weight_source import DictWeightSource
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_deep_gemm import FakeDeepGemmGemms
from sglang.test.run import run_this_file

register_cpu_ci(est_time=15)


def _spec(
    dtype: torch.dtype = torch.bfloat16, rank: int = 0, tp: int = 1, quant: bool = True
) -> LayerBuildSpec:
    return LayerBuildSpec(
        dtype=dtype, tp_rank=rank, tp_size=tp, dense_quant=FP8_BLOCK_QUANT if quant else None
    )


def _checkpoint_weight(n: int, k: int, seed: int, ue8m0: bool = True) -> BlockFp8Weight:
    """A release-style FP8 weight: e4m3 values, one power-of-two scale per 128x128 tile (UE8M0
    bytes as float8_e8m0fnu), or fp32 scales."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n).unsqueeze(1)
    q, s = block_quant_weight_fp8(w)
    if ue8m0:  # round the scale up to a power of two and requantise, as the release does
        s = torch.exp2(torch.ceil(torch.log2(s)))
        full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        q = (w / full).clamp(-448, 448).to(FP8_DTYPE)
        return BlockFp8Weight(q, s.to(torch.float8_e8m0fnu))
    return BlockFp8Weight(q, s)


def _load(layer: torch.nn.Module, full: BlockFp8Weight | torch.Tensor, name: str = "w") -> None:
    """Through the checkpoint index, as the model loader does (errors name the tensor)."""
    index, _ = CheckpointIndex.build(DictWeightSource({name: torch.zeros(1)}), lambda n: n)
    index.load_param(name, layer.weight, full)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * 2).bfloat16()


def test_resident_weight_is_fp8_plus_fp32_block_scales() -> None:
    layer = ColumnParallelLinear(384, 520, _spec())
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale_inv.dtype == torch.float32
    assert layer.weight_scale_inv.shape == (5, 3)  # ragged 520 rows: a partial last block
    resident = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
    assert resident == 520 * 384 + 4 * 5 * 3
    # a float layer (no dense_quant) and an fp32 model keep float weights, no scale buffer
    assert ColumnParallelLinear(384, 520, _spec(quant=False)).weight_scale_inv is None
    fp32 = ColumnParallelLinear(384, 520, _spec(torch.float32))
    assert fp32.weight.dtype == torch.float32 and fp32.weight_scale_inv is None


@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_slices_keep_whole_scale_blocks(tp: int, ue8m0: bool) -> None:
    full = _checkpoint_weight(512, 512, seed=tp, ue8m0=ue8m0)
    scale = full.scale_fp32()
    x = _x(5, 512, seed=1)
    want = fp8_block_gemm_torch(*_quant(x), full.weight, scale, torch.float32)
    partial_sum = torch.zeros(5, 512)
    for rank in range(tp):
        col = ColumnParallelLinear(512, 512, _spec(rank=rank, tp=tp))
        _load(col, full)
        rows = slice(rank * 512 // tp, (rank + 1) * 512 // tp)
        assert torch.equal(col.weight.view(torch.uint8), full.weight[rows].view(torch.uint8))
        blocks = slice(rank * 4 // tp, (rank + 1) * 4 // tp)
        assert torch.equal(col.weight_scale_inv, scale[blocks])
        torch.testing.assert_close(col(x).float(), want[:, rows], rtol=2**-8, atol=1e-6)

        row = RowParallelLinear(512, 512, _spec(rank=rank, tp=tp), reduce_results=False)
        _load(row, full)
        assert torch.equal(row.weight.view(torch.uint8), full.weight[:, rows].view(torch.uint8))
        assert torch.equal(row.weight_scale_inv, scale[:, blocks])
        partial_sum += row(x[:, rows]).float()
    # each rank's activation groups are the full row's groups: the partial sums add up
    torch.testing.assert_close(partial_sum, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        (lambda: ColumnParallelLinear(384, 384, _spec(rank=1, tp=2)), "192 a rank"),
        (lambda: RowParallelLinear(384, 128, _spec(rank=0, tp=2)), "192 a rank"),
        (lambda: ColumnParallelLinear(1024, 1024, _spec(rank=3, tp=16)), "64 a rank"),
    ],
)
def test_a_split_that_cuts_a_scale_block_is_refused(layer, message: str) -> None:  # type: ignore[no-untyped-def]
    built = layer()
    full = _checkpoint_weight(built.out_features, built.in_features, seed=3)
    with pytest.raises(
        WeightLoadError, match=rf"'layers.0.attn.wq_b.weight'.*size \d+ .*{message}"
    ):
        _load(built, full, "layers.0.attn.wq_b.weight")


def test_format_mismatches_are_refused() -> None:
    full = _checkpoint_weight(256, 128, seed=4)
    with pytest.raises(WeightLoadError, match=r"'a.weight'.*block-FP8.*bfloat16 tensor"):
        _load(ReplicatedLinear(128, 256, _spec()), full.dequantize(torch.bfloat16), "a.weight")
    with pytest.raises(WeightLoadError, match=r"'b.weight'.*ships this weight block-FP8"):
        _load(ReplicatedLinear(128, 256, _spec(quant=False)), full, "b.weight")
    with pytest.raises(WeightLoadError, match=r"expected shape \(128, 256\)"):
        _load(ReplicatedLinear(256, 128, _spec()), full)
    with pytest.raises(WeightFormatError, match="does not fit weight"):
        BlockFp8Weight(full.weight, full.scale[:1])
    with pytest.raises(WeightFormatError, match="2-D"):
        BlockFp8Weight(full.weight.float(), full.scale)


def test_fp32_model_dequantises_at_load_with_one_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("sglang"), "propagate", True)
    full = _checkpoint_weight(256, 256, seed=5)
    with caplog.at_level(logging.INFO, logger="sglang"):
        for rank in (0, 1):
            layer = ColumnParallelLinear(256, 256, _spec(torch.float32, rank=rank, tp=2))
            _load(layer, full)
            want = full.dequantize(torch.float32)[rank * 128 : rank * 128 + 128]
            assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, want)
    said = [r for r in caplog.records if "dequantised to torch.float32 at load" in r.getMessage()]
    assert len(said) <= 1  # once a process (an earlier test may have said it already)


def _quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = fp8_linear.quantize_activation(x)
    return a.q, a.scale


def test_forward_is_the_w8a8_reference_and_one_quantisation_serves_two_layers() -> None:
    wa, wb = _checkpoint_weight(256, 200, seed=6), _checkpoint_weight(128, 200, seed=7)
    a, b = ReplicatedLinear(200, 256, _spec()), ReplicatedLinear(200, 128, _spec())
    _load(a, wa)
    _load(b, wb)
    x = _x(7, 200, seed=2)  # ragged K: the activation is zero-padded to whole groups
    want = fp8_block_gemm_torch(*_quant(x), wa.weight, wa.scale_fp32(), torch.bfloat16)
    assert a(x).dtype == torch.bfloat16 and torch.equal(a(x), want)
    shared = a.prepare_input(x)
    assert isinstance(shared, fp8_linear.Fp8Activation) and shared.q.shape == (7, 256)
    assert torch.equal(a(shared), a(x)) and torch.equal(b(shared), b(x))
    # the maths: dequantised activation times dequantised weight, within the e4m3 rounding
    exact = x.float() @ wa.dequantize().T
    err = float((a(x).float() - exact).norm() / exact.norm())
    assert 1e-3 < err < 4e-2, err  # quantised (not a bf16 matmul in disguise), but close
    with pytest.raises(TypeError, match="not FP8"):
        ReplicatedLinear(200, 128, _spec(quant=False))(shared)


def test_grouped_layer_is_block_diagonal_and_its_epilogue_quantises() -> None:
    groups, r, k = 4, 128, 256
    full = _checkpoint_weight(groups * r, k, seed=8)
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(3, groups, k, generator=gen)).bfloat16()
    whole = GroupedColumnParallelLinear(k, groups, r, _spec())
    _load(whole, full)
    a = fp8_linear.quantize_activation(x.reshape(-1, k))
    a_q, a_s = a.q.view(3, groups, -1), a.scale.view(3, groups, -1)
    want = fp8_grouped_gemm_torch(a_q, a_s, full.weight, full.scale_fp32(), torch.bfloat16)
    assert torch.equal(whole(x), want)
    deq = full.dequantize().view(groups, r, k)
    exact = torch.einsum("tgk,grk->tgr", x.float(), deq).reshape(3, -1)
    assert float((want.float() - exact).norm() / exact.norm()) < 4e-2
    for rank in (0, 1):  # two ranks: two groups each
        half = GroupedColumnParallelLinear(k, groups, r, _spec(rank=rank, tp=2))
        _load(half, full)
        mine = x[:, rank * 2 : rank * 2 + 2]
        assert torch.equal(half(mine), want[:, rank * 2 * r : (rank + 1) * 2 * r])
    # the epilogue's FP8 equals quantising the bf16 output (here both are the torch maths)
    fused = whole.forward_quantized(x)
    q, s = _quant(want)
    assert torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fused.scale, s)
    with pytest.raises(ValueError, match="multiple of 128"):
        GroupedColumnParallelLinear(k, groups, 64, _spec()).forward_quantized(x)


def test_fused_quantisers_equal_the_unfused_path() -> None:
    from sglang.srt.layers.activation import act_and_mul
    from sglang.srt.layers.layernorm import rms_norm
    from sglang.srt.layers.mlp import gated_mlp_forward, gated_mlp_projections

    gen = torch.Generator().manual_seed(10)
    x = (torch.randn(6, 256, generator=gen) * 3).bfloat16()
    w = torch.rand(256, generator=gen) + 0.5
    fused = fp8_linear.rms_norm_quant(x, w, 1e-6)
    q, s = _quant(rms_norm(x, w, 1e-6))
    assert torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fused.scale, s)
    gate, up = x[:, :128], x[:, 128:]
    fused = fp8_linear.gated_act_quant(gate, up, "swiglu", 1.5)
    q, s = _quant(act_and_mul(x, "swiglu", swiglu_limit=1.5))
    assert torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fused.scale, s)
    # the MLP: activation + quantisation in one step equals act_and_mul then the quantiser
    g, u, d = gated_mlp_projections(256, 256, _spec(), reduce_results=False)
    for layer, seed in ((g, 11), (u, 12), (d, 13)):
        _load(layer, _checkpoint_weight(256, 256, seed=seed))
    plain = gated_mlp_forward(x, g, u, d, "swiglu", swiglu_limit=1.5)
    assert torch.equal(
        gated_mlp_forward(x, g, u, d, "swiglu", swiglu_limit=1.5, fuse_act_quant=True), plain
    )


# --------------------------------------------------------------------------------------------
# Which GEMM a shape gets on CUDA
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fake_deep_gemm(monkeypatch: pytest.MonkeyPatch) -> FakeDeepGemmGemms:
    from sglang.srt.layers.deep_gemm_adapter import DeepGemmStatus

    dg = FakeDeepGemmGemms(arch=90)
    status = DeepGemmStatus(True, "fake", dg, "0.1.5.post1")  # type: ignore[arg-type]
    monkeypatch.setattr(fp8_linear, "deep_gemm_status", lambda: status)
    return dg


def test_backend_by_shape_and_knob(
    fake_deep_gemm: FakeDeepGemmGemms, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.environ import envs
    from sglang.srt.layers.deep_gemm_adapter import DeepGemmStatus

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert fp8_linear.gemm_backend(1024, 4096, bf16, cuda)[0] == "deep_gemm"
    assert fp8_linear.gemm_backend(32768, 1024, bf16, torch.device("cpu"))[0] == "torch"
    backend, why = fp8_linear.gemm_backend(1024, 4096, torch.float16, cuda)
    assert backend == "triton" and "bf16 only" in why
    assert "K a multiple of 128" in fp8_linear.gemm_backend(1024, 200, bf16, cuda)[1]
    assert "N a multiple of 64" in fp8_linear.gemm_backend(1000, 4096, bf16, cuda)[1]
    with envs.SGLANG_FP8_DENSE_GEMM.override("triton"):
        assert fp8_linear.gemm_backend(1024, 4096, bf16, cuda) == (
            "triton",
            "SGLANG_FP8_DENSE_GEMM=triton",
        )
    off = DeepGemmStatus(False, "not installed")
    monkeypatch.setattr(fp8_linear, "deep_gemm_status", lambda: off)
    assert "not installed" in fp8_linear.gemm_backend(1024, 4096, bf16, cuda)[1]


def test_backend_choice_is_logged_once_per_shape(
    fake_deep_gemm: FakeDeepGemmGemms,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sglang.srt.environ import envs

    monkeypatch.setattr(logging.getLogger("sglang"), "propagate", True)
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger="sglang"):
        for _ in range(3):
            fp8_linear.gemm_backend(3072, 7168, torch.bfloat16, cuda)
        with envs.SGLANG_FP8_DENSE_GEMM.override("deep_gemm"):
            fp8_linear.gemm_backend(3072, 7000, torch.bfloat16, cuda)
    lines = [r for r in caplog.records if "FP8 dense GEMM N=3072" in r.getMessage()]
    assert [r.getMessage().split(": ", 1)[1].split(" ")[0] for r in lines] == [
        "deep_gemm",
        "triton",
    ]
    assert lines[1].levelno == logging.WARNING  # forced DeepGEMM could not take K=7000


def test_deep_gemm_call_gets_its_scale_layout(fake_deep_gemm: FakeDeepGemmGemms) -> None:
    full = _checkpoint_weight(192, 384, seed=14)
    x = _x(5, 384, seed=15)  # 5 rows: the scales' column stride is padded to 8
    a = fp8_linear.quantize_activation(x)
    y = fp8_linear.deep_gemm_fp8_gemm(
        fake_deep_gemm, a, full.weight, full.scale_fp32(), torch.bfloat16
    )
    want = fp8_block_gemm_torch(a.q, a.scale, full.weight, full.scale_fp32(), torch.bfloat16)
    torch.testing.assert_close(y.float(), want.float(), rtol=2**-8, atol=0)
    assert fake_deep_gemm.calls == [("fp8_fp4_gemm_nt", {"num_sms": 132, "sfa_copied": False})]
    # the fused producers hand over the same layout
    fused = fp8_linear.rms_norm_quant(x, torch.ones(384), 1e-6)
    fp8_linear.deep_gemm_fp8_gemm(
        fake_deep_gemm, fused, full.weight, full.scale_fp32(), torch.bfloat16
    )
    assert fake_deep_gemm.calls[-1][1]["sfa_copied"] is False


if __name__ == "__main__":
    run_this_file(__file__)
