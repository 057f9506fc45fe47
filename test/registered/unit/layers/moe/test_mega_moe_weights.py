"""The MegaMoE weight transform (``build_mega_moe_experts_weights``): it round-trips through its
inverse, puts rows and scales where a hand-worked small case says, rejects what the kernels cannot
take with an error naming the problem, and a FusedMoE layer on the MegaMoE path (built weights,
fake kernel reading that layout) equals the normal path on the same FP8-staged input."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
from sglang.srt.layers.moe.mega_moe_weights import (
    MegaMoEFormatError,
    MegaMoEWeightError,
    build_mega_moe_experts_weights,
    deinterleave_gate_up,
    interleave_gate_up,
    unbuild_mega_moe_experts_weights,
    unpack_ue8m0_words,
    utccp_transpose,
    utccp_untranspose,
)
from sglang.srt.layers.moe.topk import TopKConfig, select_experts
from sglang.srt.layers.quantization.mxfp4 import quant_mxfp4
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_deep_gemm import FakeDeepGemmGemms
from sglang.test.fake_mega_moe import fp8_staged, install_fake_mega_moe, mxfp4_mega_experts
from sglang.test.run import run_this_file

register_cpu_ci(est_time=5)

E, I, H = 3, 128, 256


def _mxfp4(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p13, s13 = quant_mxfp4(torch.randn(E, 2 * I, H, generator=g))
    p2, s2 = quant_mxfp4(torch.randn(E, H, I, generator=g) * 8)
    return p13, p2, s13, s2


@pytest.mark.parametrize("scale_kind", ["uint8", "e8m0", "fp32"])
def test_mxfp4_round_trip(scale_kind: str) -> None:
    p13, p2, s13, s2 = _mxfp4()
    as_kind = {
        "uint8": lambda s: s,
        "e8m0": lambda s: s.view(torch.float8_e8m0fnu),
        "fp32": lambda s: torch.exp2(s.float() - 127),
    }[scale_kind]
    dg = FakeDeepGemmGemms()
    mega = build_mega_moe_experts_weights(dg, p13, p2, as_kind(s13), as_kind(s2))
    (l1, l1_sf), (l2, l2_sf) = mega
    assert l1.dtype == l2.dtype == torch.int8 and l1_sf.dtype == l2_sf.dtype == torch.int32
    assert l1_sf.shape == (E, 2 * I, H // 128) and l2_sf.shape == (E, H, I // 128)
    assert l1_sf.stride(1) == 1 and l2_sf.stride(1) == 1, (
        "scales stay MN-major through the transform"
    )
    # DeepGEMM laid the scales out (recipe (1, 32), one call per tensor, all experts at once)
    assert [v for n, v in dg.calls if n == "transform_sf_into_required_layout"] == [
        ((E, 2 * I, H // 32), 2 * I, H),
        ((E, H, I // 32), H, I),
    ]
    back = unbuild_mega_moe_experts_weights(mega)
    assert back.fmt == "mxfp4"
    for got, want in ((back.w13, p13), (back.w2, p2), (back.w13_scale, s13), (back.w2_scale, s2)):
        assert got.dtype == torch.uint8 and torch.equal(got, want)


def test_fp8_round_trip_interleaves_rows_only() -> None:
    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.float8_e4m3fn)
    w2 = torch.randn(E, H, I, generator=g).to(torch.float8_e4m3fn)
    s13, s2 = torch.rand(E, 2 * I // 128, H // 128), torch.rand(E, H // 128, I // 128)
    dg = FakeDeepGemmGemms()
    mega = build_mega_moe_experts_weights(dg, w13, w2, s13, s2)
    assert [n for n, _ in dg.calls] == ["transform_weights_for_mega_moe_sm90"]
    (l1, l1_sf), (l2, l2_sf) = mega
    assert (
        torch.equal(l1_sf, s13)
        and torch.equal(l2_sf, s2)
        and torch.equal(l2.view(torch.uint8), w2.view(torch.uint8))
    )
    assert not torch.equal(l1.view(torch.uint8), w13.view(torch.uint8))
    back = unbuild_mega_moe_experts_weights(mega)
    assert back.fmt == "fp8" and torch.equal(back.w13.view(torch.uint8), w13.view(torch.uint8))


def test_interleave_order_by_hand() -> None:
    # I = 16: gate rows 0..15, up rows 16..31 (each row holds its own index)
    t = torch.arange(32).view(1, 32, 1).expand(1, 32, 2).contiguous()
    got = interleave_gate_up(t)[0, :, 0].tolist()
    assert got == [*range(8), *range(16, 24), *range(8, 16), *range(24, 32)]
    assert torch.equal(deinterleave_gate_up(interleave_gate_up(t)), t)


def test_utccp_order_by_hand() -> None:
    # one 128-row block: old row i*32 + j goes to new row j*4 + i
    sf = torch.arange(256, dtype=torch.int32).view(1, 128, 2)
    out = utccp_transpose(sf)[0, :, 0] // 2
    assert out[:8].tolist() == [0, 32, 64, 96, 1, 33, 65, 97]
    assert out[127].item() == 127 and out[4 * 5 + 2].item() == 2 * 32 + 5
    assert torch.equal(utccp_untranspose(utccp_transpose(sf)), sf)


def test_built_l1_scale_rows_by_hand() -> None:
    """Follow one scale byte end to end: gate row 9 / up row 9 of expert 1, K group 5."""
    p13, p2, s13, s2 = _mxfp4(seed=2)
    s13 = s13.clone()
    s13[1, 9, 5], s13[1, I + 9, 5] = 100, 101
    (_, l1_sf), _ = build_mega_moe_experts_weights(FakeDeepGemmGemms(), p13, p2, s13, s2)
    # interleaved: gate 8..15 sit at rows 16..23, up 8..15 at 24..31 -> gate 9 at 17, up 9 at 25;
    # UTCCP (block 0): row r = i*32 + j -> j*4 + i, so 17 -> 68 and 25 -> 100
    words = unpack_ue8m0_words(l1_sf)  # [E, 2I, H/32]: byte 5 is K group 5 (word 1, byte 1)
    assert words[1, 68, 5].item() == 100 and words[1, 100, 5].item() == 101


def test_wrong_inputs_name_the_problem() -> None:
    p13, p2, s13, s2 = _mxfp4()
    dg = FakeDeepGemmGemms()
    with pytest.raises(MegaMoEWeightError, match=r"MXFP4 w2 has shape \(3, 256, 32\)"):
        build_mega_moe_experts_weights(dg, p13, p2[:, :, :32], s13, s2)
    with pytest.raises(MegaMoEWeightError, match=r"w13_scale has shape"):
        build_mega_moe_experts_weights(dg, p13, p2, s13[:, :, :4], s2)
    with pytest.raises(MegaMoEWeightError, match="hidden size \\(192\\) to be a multiple of 128"):
        q13, r13 = quant_mxfp4(torch.randn(E, 2 * I, 192))
        q2, r2 = quant_mxfp4(torch.randn(E, 192, I))
        build_mega_moe_experts_weights(dg, q13, q2, r13, r2)
    with pytest.raises(MegaMoEWeightError, match="need both scales"):
        build_mega_moe_experts_weights(dg, p13, p2, None, s2)
    with pytest.raises(MegaMoEWeightError, match="powers of two"):
        build_mega_moe_experts_weights(dg, p13, p2, torch.full(s13.shape, 3.0), s2)
    with pytest.raises(
        MegaMoEFormatError, match="MXFP4 .* or FP8 .* experts; these are torch.bfloat16"
    ):
        build_mega_moe_experts_weights(
            dg, torch.zeros(E, 2 * I, H).bfloat16(), torch.zeros(E, H, I).bfloat16(), None, None
        )
    with pytest.raises(MegaMoEWeightError, match="no transform_sf_into_required_layout"):
        build_mega_moe_experts_weights(object(), p13, p2, s13, s2)


@pytest.mark.parametrize(("activation", "clamp"), [("swiglu", 0.75), ("situ", None)])
def test_layer_mega_path_equals_normal_path(
    monkeypatch: pytest.MonkeyPatch, activation: str, clamp: float | None
) -> None:
    """The fake kernel reads the built layout; on the input it staged (FP8 per 32) it must give
    the normal path's result up to its bf16 output."""
    rec = install_fake_mega_moe(monkeypatch, cap=16)
    g = torch.Generator().manual_seed(3)
    rounded, mega = mxfp4_mega_experts(
        rec.dg,
        ExpertWeights(
            torch.randn(E, 2 * I, H, generator=g) * H**-0.5,
            torch.randn(E, H, I, generator=g) * I**-0.5,
        ),
    )

    def layer(a2a: str) -> FusedMoE:
        cfg = FusedMoEConfig(
            E, H, I, 2, activation=activation, swiglu_limit=clamp, runner="torch", a2a_backend=a2a
        )  # type: ignore[arg-type]
        moe = FusedMoE(cfg)
        moe.load_weights(rounded)
        return moe

    x = torch.randn(11, H, generator=g)
    topk = select_experts(
        torch.randn(11, E, generator=g), TopKConfig(2, "sigmoid", renormalize=True)
    )
    mega_layer = layer("megamoe")
    mega_layer.set_mega_weights(mega)
    got = mega_layer(x, topk)
    assert [n for n, _ in rec.dg.calls].count("fp8_fp4_mega_moe") == 1
    want = layer("none")(fp8_staged(x), topk)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-3)
    # and the staging is what separates it from the unstaged input: a real but small difference
    plain = layer("none")(x, topk)
    assert 1e-3 < float((got.float() - plain).norm() / plain.norm()) < 5e-2


if __name__ == "__main__":
    run_this_file(__file__)
