"""The default model's config.json: a few layers of DeepSeek V4 at toy width.

Layer kinds cover the architecture: layer 0 sliding-window only with hash routing, layers 1 and 3
compressed sparse attention (ratio 4, overlapping windows, indexer top-k), layer 2 heavily
compressed attention (ratio 128). 8 heads in 4 output groups and 8 experts allow tensor parallel
up to 4.
"""

from __future__ import annotations

from typing import Any

# Prompts (plus output) are capped here; keeps the CPU server's worst case small.
CONTEXT_LENGTH = 4096


def default_model_config(vocab_size: int, bos_token_id: int, eos_token_id: int) -> dict[str, Any]:
    """config.json for a tokenizer of ``vocab_size`` tokens (the model's vocabulary matches it,
    so every sampled id decodes)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 64,
        "o_groups": 4,
        "o_lora_rank": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 64,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 8,
        "sliding_window": 32,
        "compress_ratios": [0, 4, 128, 4],
        "num_hash_layers": 1,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": CONTEXT_LENGTH // 4,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": CONTEXT_LENGTH,
        "tie_word_embeddings": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
