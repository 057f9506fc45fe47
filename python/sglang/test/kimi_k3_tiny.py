"""Tiny Kimi K3 configs and fully random models (every parameter random, never left at its initial
value) for the Kimi K3 model tests: three configs that between them take every branch of the
model, the randomiser, random experts, and a model built from a config and a seed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_config import KimiK3Config
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.test.release_checkpoint.kimi_k3 import TINY_CONFIG

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

# MegaMoE-shaped (latent 512, width 128) so the expert-parallel layout can be built too; a TP=2
# slice (64 rows) is two whole MXFP4 scale groups. Four attention heads, so TP=4 builds.
CONFIG_MEGA: dict[str, Any] = {
    **CONFIG_A,
    "routed_expert_hidden_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "linear_attn_config": {**CONFIG_A["linear_attn_config"], "num_heads": 4},
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
    """``raw``'s model with every parameter random (``seed``) and random experts (seed
    ``seed * 100 + layer id``) in ``dtype``; ``kw`` goes to the ``LayerBuildSpec`` (the torch
    MoE runner unless it names another)."""
    spec = LayerBuildSpec(**{"dtype": dtype, "moe_runner": "torch", **kw})
    model = KimiK3ForCausalLM(config(raw), spec)
    randomize_(model, seed)
    for layer in model.decoder_layers:
        if isinstance(layer.mlp, KimiK3MoE):
            layer.mlp.experts.load_weights(
                random_experts(layer.mlp, seed * 100 + layer.layer_id, dtype)
            )
    return model.eval()


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))
