"""Tiny DeepSeek V4 models for the model tests: three fixed tiny configs, a fully randomised
transformers reference, our model loaded from it, the reference written as a release
checkpoint, and the MegaMoE-tile widths with the reference's experts in the release's MXFP4."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch
from transformers import DeepseekV4Config
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.quantization.mxfp4 import quant_mxfp4
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.loading import load_weights
from sglang.test.dsv4_parity import randomize_  # one randomiser for the tests and the parity sweep
from sglang.test.release_checkpoint import deepseek_v4 as release
from sglang.test.release_checkpoint.deepseek_v4 import TINY_BASE, TINY_CONFIG
from sglang.test.release_checkpoint.emit import ReleaseCheckpoint

# transformers warns that the tiny YaRN factor disagrees with max_position_embeddings; irrelevant.
logging.getLogger("transformers").setLevel(logging.ERROR)

# The tiny configs start from the release-checkpoint kit's preset (one owner for the numbers).
_BASE: dict[str, Any] = TINY_BASE

# A: ratios 0/4/128, one hash layer, YaRN on the compressed layers, window 8, top-4 of the indexer.
CONFIG_A: dict[str, Any] = TINY_CONFIG
# B: 4 layers (4, 128, 0, 4), two hash layers, plain RoPE everywhere, a clamp that bites, fewer
# Sinkhorn iterations, more heads and groups, wider window and indexer top-k.
CONFIG_B: dict[str, Any] = dict(
    _BASE,
    hidden_size=96,
    num_hidden_layers=4,
    num_attention_heads=8,
    head_dim=48,
    qk_rope_head_dim=16,
    o_groups=4,
    n_routed_experts=8,
    num_experts_per_tok=3,
    index_topk=12,
    index_head_dim=32,
    sliding_window=16,
    compress_ratios=[4, 128, 0, 4],
    num_hash_layers=2,
    swiglu_limit=1.0,
    hc_sinkhorn_iters=5,
    rope_theta=5000.0,
    compress_rope_theta=40000.0,
    routed_scaling_factor=2.0,
)

# C: 2 layers (128, 4), no hash layer, two residual streams, hidden 128, window 32.
CONFIG_C: dict[str, Any] = dict(
    _BASE,
    hidden_size=128,
    num_hidden_layers=2,
    compress_ratios=[128, 4],
    num_hash_layers=0,
    hc_mult=2,
    sliding_window=32,
    n_routed_experts=6,
    num_experts_per_tok=2,
    index_topk=20,
    rope_scaling={
        "type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16,
        "beta_slow": 2,
    },
)


def hf_config(overrides: dict[str, Any]) -> DeepseekV4Config:
    return DeepseekV4Config(**overrides)


def reference_model(overrides: dict[str, Any], seed: int = 0) -> HFDeepseekV4:
    torch.manual_seed(seed)
    return randomize_(HFDeepseekV4(hf_config(overrides)).eval(), seed)


def our_model(
    hf: HFDeepseekV4, dtype: torch.dtype = torch.float32, **kwargs: Any
) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_hf_config(hf.config),
        LayerBuildSpec(dtype=dtype, moe_runner="torch", **kwargs),
    )
    load_weights(model, hf.state_dict(), LoadOptions(progress=False))
    return model.eval()


@torch.no_grad()
def reference_logits(hf: HFDeepseekV4, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids.unsqueeze(0)).logits[0].float()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|."""
    return float((out.float() - ref).abs().max() / ref.abs().max())


def token_ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def write_release(
    path: str | os.PathLike[str],
    config: dict[str, Any],
    hf: HFDeepseekV4,
    *,
    quantised: bool = False,
    **kw: Any,
) -> ReleaseCheckpoint:
    """``hf`` (built from ``config``) written as a DeepSeek V4 release checkpoint (release names,
    shards + index, an MTP layer). ``quantised``: FP8 dense weights and MXFP4 experts, bf16
    elsewhere, as released; otherwise every tensor unquantised in its own dtype, so the served
    model equals ``hf``."""
    formats: dict[str, Any] = (
        {} if quantised else {"dense": "bf16", "experts": "bf16", "plain_dtype": None}
    )
    formats.update(kw)  # e.g. FP8 dense weights alone: dense="fp8"
    state = release.from_transformers(hf.state_dict())
    return release.write_from_tensors(path, config, state, **formats)


# MegaMoE tiles hidden and the expert width by 128.
MEGA_SHAPES = {"hidden_size": 128, "moe_intermediate_size": 128}
_HF_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def mxfp4_release_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict with its stacked experts rewritten the way the release stores
    them: per expert ``w1``/``w3``/``w2`` packed MXFP4 plus a float8_e8m0fnu ``.scale``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _HF_EXPERTS.match(name)
        if m is None:
            out[name] = t
            continue
        inter = t.shape[1] // 2
        parts = (
            {"w1": t[:, :inter], "w3": t[:, inter:]} if m.group(2) == "gate_up_proj" else {"w2": t}
        )
        for w, stacked in parts.items():
            packed, scale = quant_mxfp4(stacked)
            for e in range(t.shape[0]):
                pre = f"layers.{m.group(1)}.ffn.experts.{e}.{w}"
                out[f"{pre}.weight"] = packed[e].clone()
                out[f"{pre}.scale"] = scale[e].clone().view(torch.float8_e8m0fnu)
    return out
