"""DeepSeek V4 config.json parsing: the release's keys and transformers' saved keys give the same
config, and a config the model cannot serve is refused with a message naming the problem."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import DeepseekV4Config

from sglang.srt.layers.rotary_embedding import YarnScaling
from sglang.srt.models.deepseek_v4_config import ConfigError, DeepseekV4ModelConfig
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=1)


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


if __name__ == "__main__":
    run_this_file(__file__)
