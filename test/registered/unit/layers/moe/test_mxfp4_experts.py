"""MXFP4 experts kept packed: the weight bundle (shapes, TP shards cut as stored, selection,
the MegaMoE layout read back), and the runners on them: the torch runner dequantises the experts
a batch routes to on use and equals the runner on the dequantised weights bit for bit; the triton
runner's W4A16 kernel is one import point, and without it the layer says so (and the decode graphs
are off with the reason)."""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.moe.fused_moe import fused_experts_torch
from sglang.srt.layers.moe.expert_weights import (
    ExpertLayout,
    ExpertWeights,
    WeightFormat,
    mxfp4_experts,
)
from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
from sglang.srt.layers.moe.mega_moe_weights import build_mega_moe_experts_weights
from sglang.srt.layers.moe.moe_runner import create_moe_runner
from sglang.srt.layers.moe.moe_runner.base import MoERunConfig
from sglang.srt.layers.moe.moe_runner.on_use import run_on_used_experts, used_experts
from sglang.srt.layers.moe.moe_runner.triton_runner import (
    TritonMoERunner,
)
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_deep_gemm import FakeDeepGemmGemms
from sglang.test.run import run_this_file

register_cpu_ci(est_time=10)

E, H, I, K = 6, 256, 128, 2


def _packed(seed: int = 0, e: int = E, h: int = H, i: int = I) -> ExpertWeights:
    """Random MXFP4 experts as a checkpoint stores them (int8 bytes, e8m0 scales), kept packed."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=gen)

    p13, p2 = rand(e, 2 * i, h // 2), rand(e, h, i // 2)
    s13, s2 = rand(e, 2 * i, h // 32, lo=118, hi=124), rand(e, h, i // 32, lo=118, hi=124)
    return mxfp4_experts(p13.view(torch.int8), p2, s13.view(torch.float8_e8m0fnu), s2)


def _routing(t: int, seed: int, e: int = E) -> TopKOutput:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:K] for _ in range(t)]).int()
    return TopKOutput(torch.rand(t, K, generator=gen), ids)


def test_the_bundle_reads_its_format_and_sizes() -> None:
    w = _packed()
    assert w.fmt is WeightFormat.MXFP4 and w.is_mxfp4 and not w.is_mega
    assert (
        w.w13.dtype == torch.uint8 and w.w13_scale is not None and w.w13_scale.dtype == torch.uint8
    )
    assert (w.num_experts, w.intermediate_size, w.hidden_size) == (E, I, H)
    assert w.describe() == "mxfp4" and w.block_shape is None
    per_param = w.nbytes / (E * 3 * H * I)
    assert per_param == pytest.approx(0.5 + 1 / 32)  # ~0.53 bytes a parameter resident
    with pytest.raises(ValueError, match="mxfp4 w13 of shape .* needs scales"):
        ExpertWeights(w.w13, w.w2, w.w13_scale[:, :, :1], w.w2_scale)
    with pytest.raises(ValueError, match="mix formats"):
        ExpertWeights(w.w13, torch.zeros(E, H, I))
    with pytest.raises(TypeError, match="UE8M0 bytes"):
        assert w.w2_scale is not None
        mxfp4_experts(w.w13, w.w2, w.w13_scale.float(), w.w2_scale)


def test_tp_shards_are_cut_as_stored_and_equal_dequantise_then_shard() -> None:
    w = _packed(1, e=2, i=256)
    full13, full2 = w.dequantized(torch.float32)
    for tp in (2, 8):
        parts = [w.shard(r, tp) for r in range(tp)]
        assert all(p.is_mxfp4 for p in parts)
        got13 = [p.dequantized(torch.float32)[0] for p in parts]
        part = 256 // tp
        gate = torch.cat([g[:, :part] for g in got13], dim=1)
        up = torch.cat([g[:, part:] for g in got13], dim=1)
        down = torch.cat([p.dequantized(torch.float32)[1] for p in parts], dim=2)
        assert torch.equal(gate, full13[:, :256]) and torch.equal(up, full13[:, 256:])
        assert torch.equal(down, full2)
    with pytest.raises(ValueError, match=r"divisible by 32"):
        w.shard(0, 16)  # 16 values a rank: half a scale group


def test_select_and_unpack_on_use_are_exact() -> None:
    w = _packed(2)
    ids = torch.tensor([4, 1])
    picked = w.select(ids)
    assert picked.is_mxfp4 and picked.num_experts == 2
    full13, full2 = w.dequantized(torch.float32)
    bf = picked.unpacked(torch.bfloat16)
    assert bf.w13.dtype == torch.bfloat16
    # E2M1 x 2^k is exact in bf16: unpacking to bf16 loses nothing
    assert torch.equal(bf.w13.float(), full13[ids]) and torch.equal(bf.w2.float(), full2[ids])


def test_megamoe_layout_reads_back_the_same_experts() -> None:
    w = _packed(3)
    assert w.w13_scale is not None and w.w2_scale is not None
    mega = ExpertWeights.from_mega(
        build_mega_moe_experts_weights(FakeDeepGemmGemms(), w.w13, w.w2, w.w13_scale, w.w2_scale)
    )
    assert mega.is_mega and mega.layout is ExpertLayout.MEGA and mega.fmt is WeightFormat.MXFP4
    assert (mega.num_experts, mega.intermediate_size, mega.hidden_size) == (E, I, H)
    assert mega.w13_scale is not None and mega.w13_scale.dtype == torch.int32
    assert mega.mega_weights[0][0] is mega.w13  # the kernel's weights are these tensors
    ids = torch.tensor([5, 0, 2])
    back, want = mega.select(ids), w.select(ids)
    assert not back.is_mega
    for a, b in zip(back.tensors(), want.tensors()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(ValueError, match="whole on each rank"):
        mega.shard(0, 2)


def test_used_experts_renumbers_and_skips_unrouted() -> None:
    ids = torch.tensor([[3, -1], [5, 3], [9, 0]], dtype=torch.int32)
    used, local = used_experts(ids, 6)
    assert used.tolist() == [0, 3, 5]
    assert local.tolist() == [[1, -1], [2, 1], [-1, 0]] and local.dtype == torch.int32


@pytest.mark.parametrize("inplace", [False, True])
def test_torch_runner_on_mxfp4_equals_the_runner_on_dequantised_weights(inplace: bool) -> None:
    w = _packed(4)
    runner = create_moe_runner("torch", MoERunConfig("swiglu", 7.0))
    why = runner.unreadable_reason(w)
    assert why is not None and "no MXFP4 kernel" in why
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(9, H, generator=gen).bfloat16()
    topk = _routing(9, 7)
    topk.topk_ids[0, 1] = -1  # an expert of another rank
    d13, d2 = w.dequantized(torch.bfloat16)
    want = fused_experts_torch(
        x, d13, d2, topk.topk_weights, topk.topk_ids, activation="swiglu", swiglu_limit=7.0
    )
    hidden = x.clone()
    got = run_on_used_experts(runner, hidden, topk, w, inplace=inplace, why=why)
    assert torch.equal(got, want)
    assert (got.data_ptr() == hidden.data_ptr()) == inplace


def test_a_rank_with_nothing_routed_returns_zeros() -> None:
    w = _packed(5)
    runner = create_moe_runner("torch", MoERunConfig())
    x = torch.randn(3, H).bfloat16()
    topk = TopKOutput(torch.rand(3, K), torch.full((3, K), -1, dtype=torch.int32))
    got = run_on_used_experts(runner, x, topk, w, inplace=False, why="test")
    assert torch.equal(got, torch.zeros_like(x))


def test_layer_forward_reads_mxfp4_on_use_and_keeps_it_packed() -> None:
    layer = FusedMoE(FusedMoEConfig(E, H, I, K, runner="torch"))
    w = _packed(8)
    layer.load_local_weights(w)
    assert layer.weights is not None and layer.weights.is_mxfp4  # no dequantised copy
    x = torch.randn(5, H).bfloat16()
    topk = _routing(5, 9)
    d13, d2 = w.dequantized(torch.bfloat16)
    want = fused_experts_torch(x, d13, d2, topk.topk_weights, topk.topk_ids)
    assert torch.equal(layer(x, topk), want)
    assert layer.weights.is_mxfp4


def test_triton_runner_hands_both_mxfp4_layouts_to_the_w4a16_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plain layout and DeepGEMM's SM100 MegaMoE layout reach the kernel as they are (no
    copy, no dequantised experts); what the kernel computes is checked in its own tests."""
    from sglang.kernels.ops.moe import fused_moe_mxfp4

    runner = TritonMoERunner(MoERunConfig())
    w = _packed(10)
    assert w.w13_scale is not None and w.w2_scale is not None
    dg = FakeDeepGemmGemms()
    mega = ExpertWeights.from_mega(
        build_mega_moe_experts_weights(dg, w.w13, w.w2, w.w13_scale, w.w2_scale)
    )
    assert runner.unreadable_reason(w) is None and runner.unreadable_reason(mega) is None
    seen: list[object] = []

    def fake_kernel(hidden: torch.Tensor, bundle: object, *args: object, **kwargs: object):
        seen.append(bundle)
        out = kwargs["out"]
        assert isinstance(out, torch.Tensor)
        return out.zero_()

    monkeypatch.setattr(fused_moe_mxfp4, "fused_experts_mxfp4_weights", fake_kernel)
    x = torch.randn(2, H).bfloat16()
    runner.run(x, _routing(2, 1), w)
    runner.run(x, _routing(2, 1), mega)
    plain, laid = seen
    assert plain.w13 is w.w13 and plain.w13_scale is w.w13_scale  # type: ignore[attr-defined]
    assert laid.w13 is mega.w13 and laid.w2_scale is mega.w2_scale  # type: ignore[attr-defined]
    assert laid.layout.gate_up_granule != plain.layout.gate_up_granule  # type: ignore[attr-defined]


def test_capture_reason_names_a_runner_reading_on_use(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = FusedMoE(FusedMoEConfig(E, H, I, K, runner="torch"))
    layer.load_local_weights(_packed(11))
    assert layer.capture_unsafe_reason == layer.runner.capture_unsafe_reason  # torch syncs anyway
    monkeypatch.setattr(type(layer.runner), "capture_safe", True)
    why = layer.capture_unsafe_reason
    assert why is not None and "reads these experts on use" in why
    layer.load_local_weights(ExpertWeights(*_packed(11).dequantized(torch.bfloat16)))
    assert layer.capture_unsafe_reason is None


if __name__ == "__main__":
    run_this_file(__file__)
