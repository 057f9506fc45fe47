"""Tiny Kimi K3 configs and fully random models, shared by the Kimi K3 model tests (imported as
``test_kimi_k3_tiny``), plus checks of that set-up itself: the configs parse as intended and the
randomisation leaves no parameter at its initial value."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_config import KimiK3Config
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.test.ci_register import register_cpu_ci
from sglang.test.release_checkpoint.kimi_k3 import TINY_CONFIG
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)

# A: K3's shape in miniature (the release-checkpoint kit's preset). 8 layers, AttnRes blocks of 3
# (bank writes at layers 0, 3, 6), MLA at 1-based 4 and 8, dense layer 0, latent MoE with norm,
# safe gate, full-rank gates.
CONFIG_A: dict[str, Any] = TINY_CONFIG
VOCAB = CONFIG_A["vocab_size"]

# B: the other branches. Blocks of 4, MLA at 1-based 1, 6 and 7 (two in a row), no q LoRA, no
# output gates, Kimi Linear's softplus gate with the low-rank output gate, no latent norm,
# routed scaling 2.5, one shared expert.
CONFIG_B: dict[str, Any] = {
    **CONFIG_A,
    "num_hidden_layers": 7,
    "attn_res_block_size": 4,
    "q_lora_rank": None,
    "mla_use_output_gate": False,
    "latent_moe_use_norm": False,
    "routed_scaling_factor": 2.5,
    "num_shared_experts": 1,
    "linear_attn_config": {
        **CONFIG_A["linear_attn_config"],
        "kda_layers": [2, 3, 4, 5],
        "full_attn_layers": [1, 6, 7],
        "use_full_rank_gate": False,
        "gate_lower_bound": None,
    },
}

# C: no AttnRes (plain pre-norm residuals) and no latent MoE (experts on the full hidden).
CONFIG_C: dict[str, Any] = {
    **CONFIG_A,
    "num_hidden_layers": 4,
    "attn_res_block_size": None,
    "routed_expert_hidden_size": None,
    "linear_attn_config": {
        **CONFIG_A["linear_attn_config"],
        "kda_layers": [1, 3, 4],
        "full_attn_layers": [2],
    },
}


def config(raw: dict[str, Any]) -> KimiK3Config:
    return KimiK3Config.from_dict(raw)


@torch.no_grad()
def randomize_(module: nn.Module, seed: int) -> None:
    """Every parameter random at a sensible scale; never left at 0/1 initial values."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("A_log"):
            v = torch.randn(p.shape, generator=g) * 0.5
        elif name.endswith("dt_bias"):
            v = torch.randn(p.shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            v = torch.randn(p.shape, generator=g) * 0.1
        elif name.endswith(("norm.weight", "layernorm.weight")):
            v = torch.rand(p.shape, generator=g) + 0.5
        elif "conv1d" in name:
            v = torch.randn(p.shape, generator=g) * 0.5
        elif name.endswith("embed_tokens.weight"):
            v = torch.randn(p.shape, generator=g)  # rows of rms ~1, like the sublayer outputs
        elif name.endswith("_res_proj.weight"):
            v = (
                torch.randn(p.shape, generator=g) * 0.25
            )  # scores of std ~2: the read mixes, not picks
        else:
            v = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
        p.copy_(v)


def random_experts(moe: KimiK3MoE, seed: int, dtype: torch.dtype = torch.float32) -> ExpertWeights:
    """All experts' full (unsharded) weights, the same for every rank given the seed."""
    c = moe.experts.config
    g = torch.Generator().manual_seed(seed)
    w13 = (
        torch.randn(c.num_experts, 2 * c.intermediate_size, c.hidden_size, generator=g)
        * c.hidden_size**-0.5
    )
    w2 = (
        torch.randn(c.num_experts, c.hidden_size, c.intermediate_size, generator=g)
        * c.intermediate_size**-0.5
    )
    return ExpertWeights(w13.to(dtype), w2.to(dtype))


def make_model(
    raw: dict[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.float32, **kw: Any
) -> KimiK3ForCausalLM:
    model = KimiK3ForCausalLM(config(raw), LayerBuildSpec(dtype=dtype, moe_runner="torch", **kw))
    randomize_(model, seed)
    for layer in model.decoder_layers:
        if isinstance(layer.mlp, KimiK3MoE):
            layer.mlp.experts.load_weights(
                random_experts(layer.mlp, seed * 100 + layer.layer_id, dtype)
            )
    return model.eval()


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# --- checks of the set-up ------------------------------------------------------------------------


def test_configs_parse_as_intended() -> None:
    a, b, c = config(CONFIG_A), config(CONFIG_B), config(CONFIG_C)
    assert a.layer_kinds == ("kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla")
    assert b.layer_kinds == ("mla", "kda", "kda", "kda", "kda", "mla", "mla")
    assert [a.is_moe(i) for i in range(8)] == [False] + [True] * 7
    assert a.num_bank_rows == 3 and b.num_bank_rows == 2 and c.attn_res_block_size is None
    assert a.kda_gate_lower_bound == -5.0 and b.kda_gate_lower_bound is None
    assert a.num_expert_group is None  # one group is a no-op


def test_randomisation_touches_every_parameter() -> None:
    fresh = KimiK3ForCausalLM(
        config(CONFIG_A), LayerBuildSpec(dtype=torch.float32, moe_runner="torch")
    )
    # A sentinel first: uninitialised parameters may reuse freed memory that an earlier test's
    # identical randomisation filled, and would then compare equal after randomize_.
    with torch.no_grad():
        for p in fresh.parameters():
            p.fill_(12345.0)
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    randomize_(fresh, seed=1)
    same = [n for n, p in fresh.named_parameters() if torch.equal(p, before[n])]
    assert same == []


def test_forward_is_finite() -> None:
    for raw in (CONFIG_A, CONFIG_B, CONFIG_C):
        model = make_model(raw, seed=2)
        ids = tokens(11, seed=3)
        logits = model(ids, torch.arange(11))
        assert (
            logits.shape == (11, VOCAB)
            and logits.dtype == torch.float32
            and torch.isfinite(logits).all()
        )


if __name__ == "__main__":
    run_this_file(__file__)
