"""DeepSeek V4 checkpoint-name mapping: release, transformers ``save_pretrained`` and transformers
in-memory names to the names the model loads."""

from __future__ import annotations

import pytest

from sglang.srt.models.deepseek_v4_checkpoint import canonical_name
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=1)


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


if __name__ == "__main__":
    run_this_file(__file__)
