"""What one DeepSeek V4 attention layer is built from: a frozen dataclass of plain facts that the
model derives from its own config (``DeepseekV4ModelConfig.attention_config``), so the layer needs
nothing from ``srt/models/``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sglang.srt.layers.quantization.dense_quant import DenseQuant
from sglang.srt.layers.rotary_embedding import RopeSpec

# sliding window only; compressed sparse (ratio 4, overlapping windows, indexer); heavily
# compressed (ratio 128)
AttnType = Literal["sliding", "csa", "hca"]


@dataclass(frozen=True)
class DeepseekV4AttentionConfig:
    hidden_size: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    kind: AttnType
    compress_ratio: int  # 0 for sliding layers
    rope: RopeSpec  # plain RoPE for sliding layers, the compressed (YaRN) one otherwise
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    q_head_norm: bool
    rms_norm_eps: float
    # How wq_a, wq_b, wkv, wo_a, wo_b and the indexer's wq_b ship (None: float); the compressor
    # and the indexer's weights_proj always ship float.
    dense_quant: DenseQuant | None = None
