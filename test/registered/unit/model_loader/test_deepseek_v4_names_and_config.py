"""DeepSeek V4 checkpoint-name mapping, config.json parsing (release keys vs transformers keys),
and the safetensors weight source."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV4Config

from sglang.srt.layers.rotary_embedding import RopeSpec, YarnScaling, rope_inv_freq
from sglang.srt.model_loader.weight_source import SafetensorsWeightSource
from sglang.srt.models.deepseek_v4_checkpoint import canonical_name
from sglang.srt.models.deepseek_v4_config import ConfigError, DeepseekV4ModelConfig
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)


@pytest.mark.parametrize(
    ("name", "want"),
    [
        # official release
        ("embed.weight", "embed.weight"),
        ("layers.3.attn.wq_a.scale", "layers.3.attn.wq_a.scale"),
        ("layers.3.attn.kv_norm.weight", "layers.3.attn.kv_norm.weight"),
        ("layers.1.attn.indexer.compressor.ape", "layers.1.attn.indexer.compressor.ape"),
        ("layers.0.ffn.gate.tid2eid", "layers.0.ffn.gate.tid2eid"),
        ("layers.2.ffn.experts.17.w2.weight", "layers.2.ffn.experts.17.w2.weight"),
        ("hc_head_fn", "hc_head_fn"),
        ("mtp.0.e_proj.weight", None),
        # transformers save_pretrained
        ("model.embed_tokens.weight", "embed.weight"),
        ("model.hc_head.hc_scale", "hc_head_scale"),
        ("model.layers.4.attn.norm.weight", "layers.4.attn.kv_norm.weight"),
        ("model.layers.4.attn.compressor.norm.weight", "layers.4.attn.compressor.norm.weight"),
        ("model.norm.weight", "norm.weight"),
        ("model.mtp.0.norm.weight", None),
        # transformers in-memory names
        ("model.layers.1.self_attn.q_a_proj.weight", "layers.1.attn.wq_a.weight"),
        ("model.layers.1.self_attn.q_a_norm.weight", "layers.1.attn.q_norm.weight"),
        ("model.layers.1.self_attn.kv_norm.weight", "layers.1.attn.kv_norm.weight"),
        ("model.layers.1.self_attn.o_a_proj.weight_scale_inv", "layers.1.attn.wo_a.scale"),
        ("model.layers.1.self_attn.sinks", "layers.1.attn.attn_sink"),
        (
            "model.layers.1.self_attn.compressor.kv_proj.weight",
            "layers.1.attn.compressor.wkv.weight",
        ),
        ("model.layers.1.self_attn.compressor.position_bias", "layers.1.attn.compressor.ape"),
        (
            "model.layers.1.self_attn.compressor.kv_norm.weight",
            "layers.1.attn.compressor.norm.weight",
        ),
        (
            "model.layers.1.self_attn.compressor.indexer.gate_proj.weight",
            "layers.1.attn.indexer.compressor.wgate.weight",
        ),
        (
            "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight",
            "layers.1.attn.indexer.wq_b.weight",
        ),
        (
            "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
            "layers.1.attn.indexer.weights_proj.weight",
        ),
        ("model.layers.1.mlp.gate.e_score_correction_bias", "layers.1.ffn.gate.bias"),
        (
            "model.layers.1.mlp.shared_experts.up_proj.weight",
            "layers.1.ffn.shared_experts.w3.weight",
        ),
        ("model.layers.1.mlp.experts.gate_up_proj", "layers.1.ffn.experts.gate_up_proj"),
        ("model.layers.1.attn_hc.base", "layers.1.hc_attn_base"),
        ("model.layers.1.post_attention_layernorm.weight", "layers.1.ffn_norm.weight"),
        ("lm_head.weight", "head.weight"),
    ],
)
def test_canonical_names(name: str, want: str | None) -> None:
    assert canonical_name(name) == want


_RELEASE = {
    "model_type": "deepseek_v4",
    "vocab_size": 1000,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 64,
    "o_lora_rank": 32,
    "o_groups": 4,
    "sliding_window": 128,
    "compress_ratios": [128, 4, 0, 4, 0],  # one extra entry: the MTP layer
    "num_hash_layers": 2,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "index_n_heads": 8,
    "index_head_dim": 64,
    "index_topk": 512,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "num_nextn_predict_layers": 1,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}


def test_release_and_transformers_configs_agree() -> None:
    ours = DeepseekV4ModelConfig.from_dict(_RELEASE)
    assert ours.attn_types == ("hca", "csa", "sliding", "csa")
    assert ours.compress_ratios == (128, 4, 0, 4)
    assert ours.hash_layers == (True, True, False, False)
    assert ours.rope_head_dim == 32 and ours.quant_method == "fp8"
    assert ours.compress_yarn == YarnScaling(16.0, 65536, 32.0, 1.0)
    hf_kwargs = {
        k: v for k, v in _RELEASE.items() if k not in ("model_type", "quantization_config")
    }
    saved = DeepseekV4Config(**hf_kwargs).to_dict()
    assert "layer_types" in saved and "compress_ratios" not in saved
    theirs = DeepseekV4ModelConfig.from_dict(saved)
    differ = {
        f.name
        for f in dataclasses.fields(DeepseekV4ModelConfig)
        if f.compare and getattr(ours, f.name) != getattr(theirs, f.name)
    }
    assert differ == {"quant_method"}, differ  # transformers drops quantization_config here


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": 2}, "one shared KV head"),
        ({"compress_ratios": [128, 2, 0, 4]}, "compress ratio 2 is not supported"),
        ({"compress_ratios": [128, 4]}, "2 entries for 4 layers"),
        ({"head_dim": None}, "'head_dim'"),
        ({"quantization_config": {"quant_method": "awq"}}, "awq"),
        ({"o_groups": 3}, "o_groups"),
    ],
)
def test_config_errors_say_what_is_wrong(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DeepseekV4ModelConfig.from_dict({**_RELEASE, **change})


def test_yarn_inv_freq_matches_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = DeepseekV4Config(
        head_dim=128,
        qk_rope_head_dim=64,
        compress_rope_theta=160000.0,
        max_position_embeddings=1 << 20,
        rope_scaling={
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config, None, layer_type="compress")
    ours = rope_inv_freq(RopeSpec(64, 160000.0, YarnScaling(16.0, 65536)))
    assert factor == 1.0
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_safetensors_source_with_and_without_index(tmp_path: Path) -> None:
    a, b = torch.arange(4.0), torch.ones(2, 3)
    save_file({"a": a}, tmp_path / "part-1.safetensors")
    save_file({"b": b}, tmp_path / "part-2.safetensors")
    source = SafetensorsWeightSource(tmp_path)
    assert sorted(source.names()) == ["a", "b"] and torch.equal(source.get("b"), b)
    index = {"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(SafetensorsWeightSource(tmp_path).get("a"), a)
    save_file({"a": a}, tmp_path / "dup.safetensors")
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="appears in both"):
        SafetensorsWeightSource(tmp_path)


if __name__ == "__main__":
    run_this_file(__file__)
