"""The wide DeepSeek V4-architecture bench model: DeepSeek V4-Flash's widths (hidden 4096, 256
routed experts top-6 of intermediate 2048 + one shared, 64 heads of 512, q rank 1024, 8 output
groups, window 128, indexer 64x128 top-512; ``sglang.test.release_checkpoint.deepseek_v4``
owns the numbers). The benchmarks build it at the depth and compression ratios they need, in
memory or as a release-format checkpoint (``deepseek_v4.write_random``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang.test.release_checkpoint.deepseek_v4 import flash_config

if TYPE_CHECKING:
    from sglang.srt.layers.attention.dsv4_attention_config import DeepseekV4AttentionConfig

BENCH_VOCAB = 4096


def wide_dsv4_config(
    ratios: list[int], *, num_hash_layers: int = 0, max_positions: int = 65536
) -> dict[str, Any]:
    """A config dict (HF names) with one layer per entry of ``ratios`` (4 or 128): the release
    kit's DeepSeek V4-Flash widths with a 4096-token vocabulary (the benchmarks send token ids)."""
    return flash_config(
        ratios,
        num_hash_layers=num_hash_layers,
        vocab_size=BENCH_VOCAB,
        max_position_embeddings=max_positions,
    )


def wide_dsv4_attention_config() -> DeepseekV4AttentionConfig:
    """The bench model's ratio-4 attention layer (with the indexer) as a layer config."""
    from sglang.srt.layers.attention.dsv4_attention_config import DeepseekV4AttentionConfig
    from sglang.srt.layers.rotary_embedding import RopeSpec, YarnScaling

    c = wide_dsv4_config([4])
    return DeepseekV4AttentionConfig(
        hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"],
        head_dim=c["head_dim"],
        q_lora_rank=c["q_lora_rank"],
        o_lora_rank=c["o_lora_rank"],
        o_groups=c["o_groups"],
        sliding_window=c["sliding_window"],
        kind="csa",
        compress_ratio=4,
        # the compressed layers' RoPE with V4-Flash's YaRN (factor 16 over 65536 positions)
        rope=RopeSpec(c["qk_rope_head_dim"], c["compress_rope_theta"], YarnScaling(16.0, 65536)),
        index_n_heads=c["index_n_heads"],
        index_head_dim=c["index_head_dim"],
        index_topk=c["index_topk"],
        q_head_norm=True,
        rms_norm_eps=c["rms_norm_eps"],
    )
