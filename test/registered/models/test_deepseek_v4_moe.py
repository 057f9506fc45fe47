"""DeepSeek V4's MoE layer on the MegaMoE path (``moe_a2a_backend="megamoe"``) against a fake
DeepGEMM: the pre-dispatch runs outside the reserved-SM context and only the kernel inside it, the
staged top-k is the layer's routing (hash layers included, routed scaling folded in), the
replicated shared expert is added, and no all-reduce follows. When the kernel cannot take the
batch, the layer's local experts run through the runner and exactly one all-reduce sums them."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.deepseek_v4_moe import DeepseekV4MoE
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_mega_moe import (
    DUMMY_MEGA_WEIGHTS,
    MEGA_CALL_ORDER,
    MegaMoERecorder,
    install_fake_mega_moe,
)
from sglang.test.run import run_this_file

register_cpu_ci(est_time=5)

H, I, E, K, V, CAP = 128, 64, 4, 2, 50, 16


def _config(layers: int = 2) -> DeepseekV4ModelConfig:
    return DeepseekV4ModelConfig.from_dict(
        {
            "vocab_size": V,
            "hidden_size": H,
            "num_hidden_layers": layers,
            "num_attention_heads": 2,
            "head_dim": 32,
            "qk_rope_head_dim": 8,
            "q_lora_rank": 16,
            "o_lora_rank": 8,
            "o_groups": 2,
            "sliding_window": 4,
            "compress_ratios": [0] * layers,
            "num_hash_layers": 1,
            "index_n_heads": 2,
            "index_head_dim": 16,
            "n_routed_experts": E,
            "num_experts_per_tok": K,
            "moe_intermediate_size": I,
            "swiglu_limit": 7.0,
            "routed_scaling_factor": 1.5,
        }
    )


def _fill(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in module.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(
                    torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(b.shape[0])])
                )


def _experts(seed: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(
        torch.randn(E, 2 * I, H, generator=g) * H**-0.5, torch.randn(E, H, I, generator=g) * I**-0.5
    )


def _moe(layer_id: int, a2a: str, tp_rank: int = 0, tp_size: int = 1) -> DeepseekV4MoE:
    moe = DeepseekV4MoE(
        _config(),
        layer_id,
        LayerBuildSpec(
            dtype=torch.float32,
            tp_rank=tp_rank,
            tp_size=tp_size,
            moe_runner="torch",
            a2a_backend=a2a,
        ),
    )
    _fill(moe, seed=layer_id)
    moe.experts.load_weights(_experts(seed=layer_id))
    if a2a == "megamoe":
        moe.experts.set_mega_weights(DUMMY_MEGA_WEIGHTS)
    return moe


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> MegaMoERecorder:
    return install_fake_mega_moe(monkeypatch, cap=CAP)


def _inputs(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, generator=g), torch.randint(0, V, (t,), generator=g)


@pytest.mark.parametrize("layer_id", [0, 1], ids=["hash-layer", "topk-layer"])
def test_mega_path_order_routing_and_no_all_reduce(rec: MegaMoERecorder, layer_id: int) -> None:
    moe = _moe(layer_id, "megamoe", tp_rank=1, tp_size=2)
    x, ids = _inputs(5)
    y = moe(x, ids)

    assert rec.call_order() == MEGA_CALL_ORDER
    kernel_kwargs = next(v for n, v in rec.dg.calls if n == "fp8_fp4_mega_moe")[1]
    assert kernel_kwargs["activation"] == "swiglu" and kernel_kwargs["activation_clamp"] == 7.0
    assert rec.all_reduces == [], "the MegaMoE output is already combined: no all-reduce"

    # The staged top-k is the layer's routing, with routed_scaling_factor folded into the weights.
    routing = moe.route(x, ids)
    buf = rec.staged[0][1]
    assert torch.equal(buf.topk_idx[:5], routing.topk_ids.long())
    assert torch.allclose(buf.topk_weights[:5], routing.topk_weights)
    assert torch.allclose(routing.topk_weights.sum(-1), torch.full((5,), 1.5))
    if layer_id == 0:
        assert torch.equal(routing.topk_ids, moe.gate.tid2eid[ids])
    assert torch.all(buf.topk_idx[5:] == -1)
    # fake kernel output (ones) plus the replicated shared expert on the local rows
    assert moe.shared_experts is not None and moe.shared_experts.w1.tp_size == 1
    assert torch.allclose(y, 1.0 + moe.shared_experts(x))


def test_fallback_runs_local_experts_and_reduces_once(rec: MegaMoERecorder) -> None:
    x, ids = _inputs(CAP + 3, seed=1)  # more rows than the MegaMoE buffer holds
    outs = [_moe(1, "megamoe", tp_rank=r, tp_size=2)(x, ids) for r in range(2)]
    assert not any(n == "fp8_fp4_mega_moe" for n, _ in rec.dg.calls)
    assert len(rec.all_reduces) == 2  # one per rank, inside FusedMoE, none in the layer
    reference = _moe(1, "none")
    shared = reference.shared_experts(x)  # type: ignore[misc]
    # each rank: its experts' partial sum (+ the all-reduce, identity here) + the shared expert
    torch.testing.assert_close(outs[0] + outs[1] - shared, reference(x, ids), rtol=1e-5, atol=1e-5)


def test_model_forward_takes_the_mega_path_in_every_layer(rec: MegaMoERecorder) -> None:
    model = DeepseekV4ForCausalLM(
        _config(layers=2),
        LayerBuildSpec(dtype=torch.float32, moe_runner="torch", a2a_backend="megamoe"),
    )
    _fill(model, seed=3)
    for i, layer in enumerate(model.layers):
        layer.ffn.experts.load_weights(_experts(seed=10 + i))
        layer.ffn.experts.set_mega_weights(DUMMY_MEGA_WEIGHTS)
    ids = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(4))
    logits = model(ids, torch.arange(6))
    assert logits.shape == (6, V) and torch.isfinite(logits).all()
    assert [n for n, _ in rec.dg.calls].count("fp8_fp4_mega_moe") == 2
    assert [n for n, _ in rec.dg.calls].count("pre_dispatch") == 2
    assert rec.all_reduces == []


if __name__ == "__main__":
    run_this_file(__file__)
