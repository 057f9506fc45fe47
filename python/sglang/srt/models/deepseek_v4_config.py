"""DeepSeek V4 model configuration: one frozen dataclass, parsed from a config.json dict (the
official release keys or the keys transformers' ``DeepseekV4Config.save_pretrained`` writes) or
from a ``DeepseekV4Config`` object.

Two spellings exist for the same facts:
- release / legacy: ``compress_ratios`` (one int per layer, 0/4/128, possibly with extra entries
  for the MTP layer), ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling`` (YaRN for the
  compressed layers), ``compress_rope_theta``;
- transformers: ``layer_types`` + ``compress_rates``, ``mlp_layer_types``,
  ``partial_rotary_factor``, ``rope_parameters = {"main": ..., "compress": ...}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.layers.attention.dsv4_attention_config import AttnType, DeepseekV4AttentionConfig
from sglang.srt.layers.quantization.dense_quant import FP8_BLOCK_QUANT, DenseQuant
from sglang.srt.layers.rotary_embedding import RopeSpec, YarnScaling
from sglang.srt.models.config_common import ConfigError, JsonModelConfig, required

_LAYER_TYPE_NAMES: dict[str, AttnType] = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
# Ratio -> kind in release configs: ratio 4 has the overlapping windows and the indexer.
_RATIO_KIND: dict[int, AttnType] = {0: "sliding", 4: "csa", 128: "hca"}


@dataclass(frozen=True)
class DeepseekV4ModelConfig(JsonModelConfig):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    attn_types: tuple[AttnType, ...]
    compress_ratios: tuple[int, ...]  # 0 for sliding layers
    hash_layers: tuple[bool, ...]
    rope_theta: float
    compress_rope_theta: float
    compress_yarn: YarnScaling | None
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float | None
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    q_head_norm: bool = True
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    quant_method: str | None = None  # "fp8" when the dense weights ship FP8 128x128 blocks
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        for name in ("attn_types", "compress_ratios", "hash_layers"):
            if len(getattr(self, name)) != n:
                raise ConfigError(f"{name} has {len(getattr(self, name))} entries for {n} layers")
        for i, (kind, ratio) in enumerate(zip(self.attn_types, self.compress_ratios)):
            if (kind == "sliding") != (ratio == 0):
                raise ConfigError(f"layer {i}: attention type {kind!r} with compress ratio {ratio}")
            if kind == "csa" and ratio < 1:
                raise ConfigError(
                    f"layer {i}: compressed sparse attention needs a ratio >= 1, got {ratio}"
                )
        if self.head_dim <= self.rope_head_dim:
            raise ConfigError(f"head_dim {self.head_dim} must exceed rope dim {self.rope_head_dim}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError(
                f"{self.num_attention_heads} heads x {self.head_dim} not divisible by "
                f"o_groups {self.o_groups}"
            )
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} not divisible by "
                f"o_groups {self.o_groups}"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok {self.num_experts_per_tok} > "
                f"n_routed_experts {self.n_routed_experts}"
            )
        if self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.index_topk < 1:
            raise ConfigError(f"index_topk must be >= 1, got {self.index_topk}")

    # --- derived -------------------------------------------------------------------------------

    @property
    def main_rope(self) -> RopeSpec:
        """Plain RoPE of the sliding-only layers."""
        return RopeSpec(self.rope_head_dim, self.rope_theta)

    @property
    def compress_rope(self) -> RopeSpec:
        """RoPE (YaRN when configured) of compressed layers: q, window K, compressed K, indexer."""
        return RopeSpec(self.rope_head_dim, self.compress_rope_theta, self.compress_yarn)

    @property
    def dense_quant(self) -> DenseQuant | None:
        """How the dense layers that ship quantised are stored (``quantization_config``): FP8
        128x128 blocks for attention's wq_a/wq_b/wkv/wo_a/wo_b, the indexer's wq_b and the
        shared expert; compressor, indexer weights_proj, router, embedding and head stay
        float."""
        return FP8_BLOCK_QUANT if self.quant_method == "fp8" else None

    def rope_for_layer(self, layer: int) -> RopeSpec:
        return self.main_rope if self.attn_types[layer] == "sliding" else self.compress_rope

    def attention_config(self, layer: int) -> DeepseekV4AttentionConfig:
        """What layer ``layer``'s attention is built from."""
        return DeepseekV4AttentionConfig(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            q_lora_rank=self.q_lora_rank,
            o_lora_rank=self.o_lora_rank,
            o_groups=self.o_groups,
            sliding_window=self.sliding_window,
            kind=self.attn_types[layer],
            compress_ratio=self.compress_ratios[layer],
            rope=self.rope_for_layer(layer),
            index_n_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim,
            index_topk=self.index_topk,
            q_head_norm=self.q_head_norm,
            rms_norm_eps=self.rms_norm_eps,
            dense_quant=self.dense_quant,
        )

    # --- parsing -------------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> DeepseekV4ModelConfig:
        """From a transformers ``DeepseekV4Config`` (or anything with ``to_dict``)."""
        return cls.from_dict(hf_config.to_dict())

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DeepseekV4ModelConfig:
        d = dict(raw)
        model_type = d.get("model_type", "deepseek_v4")
        if model_type != "deepseek_v4":
            raise ConfigError(f"model_type {model_type!r} is not deepseek_v4")
        n = required(d, "num_hidden_layers")
        heads = required(d, "num_attention_heads")
        kv_heads = d.get("num_key_value_heads", 1)
        if kv_heads != 1:
            raise ConfigError(
                f"DeepSeek V4 attention has one shared KV head; num_key_value_heads={kv_heads}"
            )
        head_dim = required(d, "head_dim")
        attn_types, ratios = _parse_attention_layers(d, n)
        rope_dim = _parse_rope_dim(d, head_dim)
        rope_theta, compress_theta, yarn = _parse_rope(d)
        quant = d.get("quantization_config") or {}
        quant_method = quant.get("quant_method") if isinstance(quant, Mapping) else None
        if quant_method is not None and quant_method != "fp8":
            raise ConfigError(f"quantization method {quant_method!r} is not supported (only fp8)")
        if quant_method == "fp8":
            block = tuple(quant.get("weight_block_size", (128, 128)))
            if block != (128, 128):
                raise ConfigError(f"FP8 weight_block_size {block} is not supported (only 128x128)")
        swiglu_limit = d.get("swiglu_limit", 10.0)
        return cls(
            vocab_size=required(d, "vocab_size"),
            hidden_size=required(d, "hidden_size"),
            num_hidden_layers=n,
            num_attention_heads=heads,
            head_dim=head_dim,
            rope_head_dim=rope_dim,
            q_lora_rank=required(d, "q_lora_rank"),
            o_lora_rank=required(d, "o_lora_rank"),
            o_groups=required(d, "o_groups"),
            sliding_window=d.get("sliding_window", 128),
            attn_types=attn_types,
            compress_ratios=ratios,
            hash_layers=_parse_hash_layers(d, n),
            rope_theta=float(rope_theta),
            compress_rope_theta=float(compress_theta),
            compress_yarn=yarn,
            index_n_heads=d.get("index_n_heads", 64),
            index_head_dim=d.get("index_head_dim", 128),
            index_topk=d.get("index_topk", 512),
            n_routed_experts=required(d, "n_routed_experts"),
            num_experts_per_tok=required(d, "num_experts_per_tok"),
            n_shared_experts=d.get("n_shared_experts", 1),
            moe_intermediate_size=required(d, "moe_intermediate_size"),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            # DeepSeek's reference clamps only for a limit > 0 (its default 0 means no clamp).
            swiglu_limit=None if swiglu_limit is None or swiglu_limit <= 0 else float(swiglu_limit),
            scoring_func=d.get("scoring_func", "sqrtsoftplus"),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            q_head_norm=bool(d.get("q_head_norm", True)),
            hc_mult=d.get("hc_mult", 4),
            hc_sinkhorn_iters=d.get("hc_sinkhorn_iters", 20),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=d.get("max_position_embeddings", 1048576),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=d.get("num_nextn_predict_layers", 0),
            quant_method=quant_method,
            extra=d,
        )


def _parse_attention_layers(
    d: Mapping[str, Any], n: int
) -> tuple[tuple[AttnType, ...], tuple[int, ...]]:
    layer_types = d.get("layer_types")
    if layer_types is not None:
        rates = {**_DEFAULT_COMPRESS_RATES, **(d.get("compress_rates") or {})}
        if len(layer_types) < n:
            raise ConfigError(f"layer_types has {len(layer_types)} entries for {n} layers")
        kinds, ratios = [], []
        for i, name in enumerate(layer_types[:n]):
            if name not in _LAYER_TYPE_NAMES:
                raise ConfigError(f"layer {i}: unknown layer type {name!r}")
            kind = _LAYER_TYPE_NAMES[name]
            kinds.append(kind)
            ratios.append(0 if kind == "sliding" else int(rates[name]))
        return tuple(kinds), tuple(ratios)
    legacy = d.get("compress_ratios")
    if legacy is None:
        raise ConfigError("config.json has neither layer_types nor compress_ratios")
    # Release configs may list one more entry, for the MTP layer; only the first n are ours.
    if len(legacy) < n:
        raise ConfigError(f"compress_ratios has {len(legacy)} entries for {n} layers")
    kinds_l: list[AttnType] = []
    for i, r in enumerate(legacy[:n]):
        if int(r) not in _RATIO_KIND:
            raise ConfigError(
                f"layer {i}: compress ratio {r} is not supported (expected 0, 4 or 128)"
            )
        kinds_l.append(_RATIO_KIND[int(r)])
    return tuple(kinds_l), tuple(int(r) for r in legacy[:n])


def _parse_hash_layers(d: Mapping[str, Any], n: int) -> tuple[bool, ...]:
    mlp_types = d.get("mlp_layer_types")
    if mlp_types is not None:
        if len(mlp_types) < n:
            raise ConfigError(f"mlp_layer_types has {len(mlp_types)} entries for {n} layers")
        bad = [t for t in mlp_types[:n] if t not in ("hash_moe", "moe")]
        if bad:
            raise ConfigError(f"unknown mlp_layer_types {bad}")
        return tuple(t == "hash_moe" for t in mlp_types[:n])
    k = d.get("num_hash_layers", d.get("n_hash_layers", 0)) or 0
    return tuple(i < k for i in range(n))


def _parse_rope_dim(d: Mapping[str, Any], head_dim: int) -> int:
    if d.get("qk_rope_head_dim") is not None:
        return int(d["qk_rope_head_dim"])
    factor = d.get("partial_rotary_factor")
    if factor is None:
        return 64
    return int(head_dim * factor)


def _yarn_from(p: Mapping[str, Any]) -> YarnScaling | None:
    kind = p.get("rope_type", p.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ConfigError(f"rope type {kind!r} is not supported for DeepSeek V4 (only yarn)")
    return YarnScaling(
        factor=float(p["factor"]),
        original_max_position_embeddings=int(p["original_max_position_embeddings"]),
        beta_fast=float(p.get("beta_fast") or 32),
        beta_slow=float(p.get("beta_slow") or 1),
        # V4 applies no YaRN mscale; an explicit value in the config is honoured.
        attention_factor=float(p.get("attention_factor", 1.0)),
        truncate=bool(p.get("truncate", True)),
    )


def _parse_rope(d: Mapping[str, Any]) -> tuple[float, float, YarnScaling | None]:
    params = d.get("rope_parameters")
    if (
        isinstance(params, Mapping)
        and isinstance(params.get("main"), Mapping)
        and isinstance(params.get("compress"), Mapping)
    ):
        main, comp = params["main"], params["compress"]
        if _yarn_from(main) is not None:
            raise ConfigError("YaRN on the sliding-only layers ('main' rope) is not supported")
        return main["rope_theta"], comp["rope_theta"], _yarn_from(comp)
    scaling = d.get("rope_scaling")
    if scaling is None and isinstance(params, Mapping):
        scaling = params
    yarn = _yarn_from(scaling) if isinstance(scaling, Mapping) else None
    return d.get("rope_theta", 10000.0), d.get("compress_rope_theta", 160000.0), yarn
