"""Kimi K3's latent MoE block against a hand-written torch reference (router on the full hidden,
sigmoid + bias top-k, latent down projection, experts with SiTU, RMSNorm of the routed sum, up
projection, shared experts), and its MegaMoE path against a fake DeepGEMM: the buffer and the
pre-dispatch come first and only ``fp8_fp4_mega_moe(..., activation="situ")`` runs inside the
reserved-SM context, with the latent (not the hidden) as the kernel's width and no all-reduce."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.a2a import base as a2a_base
from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
from sglang.srt.models.kimi_k3_config import ConfigError
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_mega_moe import (
    DUMMY_MEGA_WEIGHTS,
    MEGA_CALL_ORDER,
    MegaMoERecorder,
    install_fake_mega_moe,
)
from sglang.test.kimi_k3_reference import moe_reference, situ_reference
from sglang.test.kimi_k3_tiny import (
    CONFIG_A,
    CONFIG_B,
    CONFIG_C,
    config,
    random_experts,
    randomize_,
)
from sglang.test.run import run_this_file

register_cpu_ci(est_time=5)


def _moe(raw: dict[str, Any], seed: int, **kw: Any) -> KimiK3MoE:
    spec = LayerBuildSpec(dtype=torch.float32, moe_runner="torch", **kw)
    moe = KimiK3MoE(config(raw), spec)
    randomize_(moe, seed)
    moe.experts.load_weights(random_experts(moe, seed))
    return moe


def _x(t: int, h: int, seed: int) -> torch.Tensor:
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "raw", [CONFIG_A, CONFIG_B, CONFIG_C], ids=["latent+norm", "no-norm,rsf=2.5", "no-latent"]
)
def test_moe_block_equals_hand_written_reference(raw: dict[str, Any]) -> None:
    moe = _moe(raw, seed=1)
    c = config(raw)
    x = _x(13, c.hidden_size, seed=2)
    with torch.no_grad():
        got = moe(x)
    want = moe_reference(moe, x, rsf=c.routed_scaling_factor, eps=c.rms_norm_eps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the correction bias really steers the choice here (so the test covers it)
    assert moe.gate.e_score_correction_bias is not None
    scores = torch.sigmoid(moe.gate.logits(x))
    unbiased = scores.topk(c.num_experts_per_token).indices.sort().values
    assert not torch.equal(unbiased, moe.route(x).topk_ids.long().sort().values)


def test_bf16_moe_block_is_close_to_reference() -> None:
    moe = _moe(CONFIG_A, seed=3)
    moe_bf16 = KimiK3MoE(config(CONFIG_A), LayerBuildSpec(dtype=torch.bfloat16, moe_runner="torch"))
    moe_bf16.load_state_dict(moe.state_dict())
    moe_bf16.experts.load_weights(random_experts(moe, seed=3, dtype=torch.bfloat16))
    x = _x(9, 64, seed=4)
    with torch.no_grad():
        got = moe_bf16(x.bfloat16()).float()
    want = moe_reference(moe, x, rsf=1.0, eps=1e-5)
    rel = float((got - want).norm() / want.norm())
    assert rel < 2e-2, rel


def test_tp_normal_path_reduces_the_latent_sum_before_its_norm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TP=2 by hand: each rank's all-reduces are recorded; summing the two ranks' recorded
    partials reproduces the TP=1 block only if the latent [T, L] sum is what is reduced (then
    normed), and the shared experts' [T, H] partials are reduced separately."""
    from sglang.srt.layers import linear as linear_mod

    calls: list[torch.Tensor] = []

    def record(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.clone())
        return x

    monkeypatch.setattr(a2a_base, "tensor_model_parallel_all_reduce", record)
    monkeypatch.setattr(linear_mod, "tensor_model_parallel_all_reduce", record)
    c = config(CONFIG_A)
    x = _x(7, c.hidden_size, seed=8)
    whole = _moe(CONFIG_A, seed=9)
    with torch.no_grad():
        want = whole(x)
    partials: list[list[torch.Tensor]] = []
    for rank in range(2):
        calls.clear()
        moe = KimiK3MoE(
            c, LayerBuildSpec(dtype=torch.float32, moe_runner="torch", tp_rank=rank, tp_size=2)
        )
        full = dict(whole.named_parameters())
        for name, p in moe.named_parameters():
            loader = getattr(p, "weight_loader", None)
            if loader is None:  # replicated norms
                p.data.copy_(full[name])
            else:  # this rank's shard of the full tensor
                loader(p, full[name])
        assert whole.experts.weights is not None
        moe.experts.load_weights(whole.experts.weights)
        with torch.no_grad():
            moe(x)
        partials.append(list(calls))
    shapes = sorted(tuple(t.shape) for t in partials[0])
    assert shapes == [(7, 32), (7, c.hidden_size)], shapes  # the latent [T, L], the shared [T, H]
    latent = next(i for i, t in enumerate(partials[0]) if t.shape[1] == 32)
    shared = 1 - latent
    moe = whole
    assert moe.routed_expert_norm is not None and moe.routed_expert_up_proj is not None
    with torch.no_grad():
        y = partials[0][latent] + partials[1][latent]
        got = (
            moe.routed_expert_up_proj(moe.routed_expert_norm(y))
            + partials[0][shared]
            + partials[1][shared]
        )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- MegaMoE ------------------------------------------------------------------------------------

# MegaMoE's shapes: latent a multiple of 512, expert width a multiple of 128.
MEGA = {
    **CONFIG_A,
    "routed_expert_hidden_size": 512,
    "moe_intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_token": 2,
}
CAP = 16


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> MegaMoERecorder:
    return install_fake_mega_moe(monkeypatch, cap=CAP)


def _mega_moe(tp_rank: int = 1, tp_size: int = 2) -> KimiK3MoE:
    moe = _moe(MEGA, seed=5, tp_rank=tp_rank, tp_size=tp_size, a2a_backend="megamoe")
    moe.experts.set_mega_weights(DUMMY_MEGA_WEIGHTS)
    return moe


def test_mega_path_call_order_situ_and_no_all_reduce(rec: MegaMoERecorder) -> None:
    moe = _mega_moe()
    x = _x(5, 64, seed=6)
    with torch.no_grad():
        y = moe(x)
    assert rec.call_order() == MEGA_CALL_ORDER
    kwargs = next(v for n, v in rec.dg.calls if n == "fp8_fp4_mega_moe")[1]
    assert kwargs == {
        "activation": "situ",
        "fast_math": True,
        "recipe": (1, 1, 32),
    }  # no clamp with SiTU
    # the kernel's width is the latent (the buffer rows), and the staged rows are z = down(x)
    staged_x, buf = rec.staged[0]
    assert buf.x.shape[1] == 512 and staged_x.shape == (5, 512)
    assert moe.routed_expert_down_proj is not None
    torch.testing.assert_close(staged_x, moe.routed_expert_down_proj(x))
    routing = moe.route(x)
    assert torch.equal(buf.topk_idx[:5], routing.topk_ids.long()) and torch.all(
        buf.topk_idx[5:] == -1
    )
    assert torch.allclose(buf.topk_weights[:5], routing.topk_weights)
    assert rec.all_reduces == []
    # the fake kernel fills the latent with ones: out = up(norm(1)) + replicated shared experts
    assert moe.shared_experts is not None and moe.shared_experts.gate_proj.tp_size == 1
    assert moe.routed_expert_norm is not None and moe.routed_expert_up_proj is not None
    ones = torch.ones(5, 512)
    want = moe.routed_expert_up_proj(moe.routed_expert_norm(ones)) + moe.shared_experts(x)
    torch.testing.assert_close(y, want)


def test_mega_fallback_reduces_the_latent_before_the_norm(rec: MegaMoERecorder) -> None:
    """Beyond the buffer's capacity FusedMoE runs this rank's experts itself: the partial latent
    sums are all-reduced (here: summed by hand over the two ranks) before the norm."""
    x = _x(CAP + 2, 64, seed=7)
    ranks = [_mega_moe(tp_rank=r) for r in range(2)]
    partial = []
    for moe in ranks:
        with torch.no_grad():
            moe(x)
        partial.append(rec.all_reduces[-1])
    assert not any(n == "fp8_fp4_mega_moe" for n, _ in rec.dg.calls)
    assert all(p.shape == (CAP + 2, 512) for p in partial), "the all-reduce must carry the latent"
    whole = _moe(MEGA, seed=5)
    want = moe_reference(whole, x, rsf=1.0, eps=1e-5)
    moe = ranks[0]
    assert moe.routed_expert_norm is not None and moe.routed_expert_up_proj is not None
    with torch.no_grad():
        got = moe.routed_expert_up_proj(
            moe.routed_expert_norm(partial[0] + partial[1])
        ) + moe.shared_experts(x)  # type: ignore[misc]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_model_wires_its_mega_call_site_and_it_runs_situ(rec: MegaMoERecorder) -> None:
    """KimiK3ForCausalLM's MoE layers run the MegaMoE kernel through the same experts call as
    every backend; the block's MegaMoE call site, KimiK3MoE._forward_mega_experts, runs the
    layer's SiTU experts through the kernel alone and refuses any other activation."""
    from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM

    model = KimiK3ForCausalLM(
        config(MEGA), LayerBuildSpec(dtype=torch.float32, moe_runner="torch", a2a_backend="megamoe")
    )
    blocks = [layer.mlp for layer in model.decoder_layers if isinstance(layer.mlp, KimiK3MoE)]
    assert blocks and all(b.experts.a2a.name == "megamoe" for b in blocks)
    moe = _mega_moe()
    z = _x(3, 512, seed=9)
    topk = moe.route(_x(3, 64, seed=9))
    kernel = moe.experts.mega_kernel_for(z)
    assert kernel is not None
    y = moe._forward_mega_experts(z, topk, kernel)
    assert y.dtype == z.dtype and [n for n, _ in rec.dg.calls].count("fp8_fp4_mega_moe") == 1
    moe.experts = FusedMoE(
        FusedMoEConfig(4, 512, 128, 2, activation="swiglu", a2a_backend="megamoe")
    )
    with pytest.raises(ValueError, match="SiTU experts, not 'swiglu'"):
        moe._forward_mega_experts(z, topk, kernel)


def test_mega_rejects_unsupported_shapes() -> None:
    with pytest.raises(ConfigError, match="divisible by 512"):
        KimiK3MoE(
            config(CONFIG_A),
            LayerBuildSpec(dtype=torch.float32, moe_runner="torch", a2a_backend="megamoe"),
        )
    with pytest.raises(ConfigError, match="hidden_act 'situ'"):
        KimiK3MoE(
            config({**MEGA, "hidden_act": "silu"}),
            LayerBuildSpec(dtype=torch.float32, a2a_backend="megamoe"),
        )


def test_situ_reference_matches_the_engine() -> None:
    from sglang.srt.layers.activation import situ_torch

    g = torch.linspace(-40, 40, 81)
    u = torch.linspace(-90, 90, 81)
    torch.testing.assert_close(situ_torch(torch.cat([g, u])[None]), situ_reference(g, u)[None])
    assert math.isclose(
        float(situ_reference(torch.tensor(1e4), torch.tensor(1e4))), 100.0, rel_tol=1e-6
    )


if __name__ == "__main__":
    run_this_file(__file__)
