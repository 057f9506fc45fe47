"""The wide DeepSeek V4-architecture bench model: hidden 4096, 256 routed experts top-6
(intermediate 2048) + one shared, 64 heads of 512 (q rank 1024, 8 output groups), window 128,
indexer 64x128 top-512. The benchmarks build it at the depth and compression ratios they need."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.layers.attention.dsv4_attention_config import DeepseekV4AttentionConfig


def wide_dsv4_config(
    ratios: list[int], *, num_hash_layers: int = 0, max_positions: int = 65536
) -> dict[str, Any]:
    """A config dict (HF names) with one layer per entry of ``ratios`` (4 or 128)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": 4096,
        "hidden_size": 4096,
        "num_hidden_layers": len(ratios),
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "n_routed_experts": 256,
        "num_experts_per_tok": 6,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "sliding_window": 128,
        "compress_ratios": list(ratios),
        "num_hash_layers": num_hash_layers,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


def wide_dsv4_attention_config() -> DeepseekV4AttentionConfig:
    """The bench model's ratio-4 attention layer (with the indexer) as a layer config."""
    from sglang.srt.layers.attention.dsv4_attention_config import DeepseekV4AttentionConfig
    from sglang.srt.layers.rotary_embedding import RopeSpec, YarnScaling

    return DeepseekV4AttentionConfig(
        hidden_size=4096,
        num_attention_heads=64,
        head_dim=512,
        q_lora_rank=1024,
        o_lora_rank=1024,
        o_groups=8,
        sliding_window=128,
        kind="csa",
        compress_ratio=4,
        rope=RopeSpec(64, 160000.0, YarnScaling(16.0, 65536)),
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        q_head_norm=True,
        rms_norm_eps=1e-6,
    )
