"""Kimi K3 model configuration: one frozen dataclass parsed from config.json.

Accepted: the multimodal wrapper (``model_type: "kimi_k3"`` with a ``text_config``; a
``quantization_config`` may sit outside or inside it) or the flat text config
(``model_type: "kimi_linear"``). The attention schedule comes from
``linear_attn_config.kda_layers`` / ``full_attn_layers``, which are **1-based**; both must be
present and together name every layer exactly once. Without a ``linear_attn_config`` every layer
is MLA.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.layers.activation import SITU_BETA, SITU_LINEAR_BETA, Activation
from sglang.srt.mem_cache.kimi_k3_cache import KimiK3CacheShape, LayerKind
from sglang.srt.models.config_common import ConfigError, JsonModelConfig, required

_TEXT_MODEL_TYPES = ("kimi_linear", "kimi_k3")


@dataclass(frozen=True)
class KimiK3Config(JsonModelConfig):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_kinds: tuple[LayerKind, ...]
    # dense MLP (layers < first_k_dense_replace) and activation of every MLP and expert
    intermediate_size: int
    hidden_act: str = "situ"
    rms_norm_eps: float = 1e-5
    # MLA
    num_attention_heads: int = 1
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_output_gate: bool = True
    # KDA
    kda_num_heads: int = 1
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_full_rank_gate: bool = True
    kda_gate_lower_bound: float | None = -5.0
    kda_state_dtype: str = "float32"
    # MoE
    num_experts: int = 0
    num_experts_per_token: int = 1
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    routed_expert_hidden_size: int | None = None  # latent width; None: experts on the full hidden
    latent_moe_use_norm: bool = True
    router_scoring: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    use_correction_bias: bool = True  # topk_method == "noaux_tc"
    num_expert_group: int | None = None
    topk_group: int | None = None
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    # residual stream
    attn_res_block_size: int | None = None  # None: plain pre-norm residuals
    # head
    tie_word_embeddings: bool = False
    logit_scale: float = 1.0
    max_position_embeddings: int = 1048576
    expert_quant_format: str | None = None  # "mxfp4" for compressed-tensors mxfp4-pack-quantized
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_kinds) != n:
            raise ConfigError(f"layer_kinds has {len(self.layer_kinds)} entries for {n} layers")
        if self.hidden_act not in ("situ", "silu"):
            raise ConfigError(
                f"hidden_act {self.hidden_act!r} is not supported (expected 'situ' or 'silu')"
            )
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ConfigError(
                f"attn_res_block_size must be >= 1 or null, got {self.attn_res_block_size}"
            )
        if self.router_scoring not in ("sigmoid", "softmax"):
            raise ConfigError(
                f"moe_router_activation_func {self.router_scoring!r} is not supported"
            )
        if self.kda_state_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"KDA state dtype {self.kda_state_dtype!r} is not supported")
        if any(self.is_moe(i) for i in range(n)):
            if self.num_experts < 1 or self.moe_intermediate_size < 1:
                raise ConfigError("MoE layers need num_experts and moe_intermediate_size")
            if not 1 <= self.num_experts_per_token <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_token {self.num_experts_per_token} must be in [1, "
                    f"{self.num_experts}]"
                )
        if self.moe_layer_freq < 1:
            raise ConfigError(f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")

    # --- derived -------------------------------------------------------------------------------

    def is_kda(self, layer: int) -> bool:
        return self.layer_kinds[layer] == "kda"

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def moe_activation(self) -> Activation:
        """The MoE layer's / ``act_and_mul``'s name for ``hidden_act``."""
        return "situ" if self.hidden_act == "situ" else "swiglu"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_bank_rows(self) -> int:
        """How many block snapshots the AttnRes bank can hold (one per write layer)."""
        b = self.attn_res_block_size
        return 0 if b is None else -(-self.num_hidden_layers // b)

    def cache_shape(self, kda_heads: int) -> KimiK3CacheShape:
        """What one request's cache holds (also a slot of the pool, and the memory model's
        shape); ``kda_heads`` is this rank's head count."""
        return KimiK3CacheShape(
            layer_kinds=tuple(self.layer_kinds),
            kda_heads=kda_heads,
            kda_head_dim=self.kda_head_dim,
            conv_size=self.kda_conv_size,
            latent_dim=self.mla_latent_dim,
        )

    # --- parsing -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KimiK3Config:
        d = dict(raw)
        quant = d.get("quantization_config")
        if isinstance(d.get("text_config"), Mapping):
            d = dict(d["text_config"])
            quant = d.get("quantization_config", quant)
        model_type = d.get("model_type", "kimi_linear")
        if model_type not in _TEXT_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not a Kimi K3 text config ({_TEXT_MODEL_TYPES})"
            )
        n = int(required(d, "num_hidden_layers"))
        lin = d.get("linear_attn_config") or {}
        heads = int(required(d, "num_attention_heads"))
        kv_heads = d.get("num_key_value_heads") or heads
        if kv_heads != heads:
            raise ConfigError(
                f"MLA needs num_key_value_heads == num_attention_heads, got {kv_heads} and {heads}"
            )
        act = d.get("hidden_act", "silu")
        _check_situ(d, act)
        topk_method = d.get("topk_method", "noaux_tc")
        groups = d.get("num_expert_group", d.get("n_group"))
        kept = d.get("topk_group")
        if not d.get("use_grouped_topk", True) or groups in (None, 1):
            groups = kept = None  # one group is a no-op
        return cls(
            vocab_size=int(required(d, "vocab_size")),
            hidden_size=int(required(d, "hidden_size")),
            num_hidden_layers=n,
            layer_kinds=_parse_layer_kinds(lin, n),
            intermediate_size=int(required(d, "intermediate_size")),
            hidden_act=act,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            num_attention_heads=heads,
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=int(d.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(d.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(d.get("qk_rope_head_dim", 64)),
            v_head_dim=int(d.get("v_head_dim", 128)),
            mla_use_output_gate=bool(d.get("mla_use_output_gate", False)),
            kda_num_heads=int(lin.get("num_heads", 1)),
            kda_head_dim=int(lin.get("head_dim", 128)),
            kda_conv_size=int(lin.get("short_conv_kernel_size", 4)),
            kda_full_rank_gate=bool(lin.get("use_full_rank_gate", False)),
            kda_gate_lower_bound=_opt_float(lin.get("gate_lower_bound")),
            kda_state_dtype=str(d.get("mamba_ssm_dtype") or "float32"),
            num_experts=int(d.get("num_experts", d.get("n_routed_experts", 0)) or 0),
            num_experts_per_token=int(
                d.get("num_experts_per_token", d.get("num_experts_per_tok", 1)) or 1
            ),
            num_shared_experts=int(d.get("num_shared_experts", d.get("n_shared_experts", 0)) or 0),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 0) or 0),
            routed_expert_hidden_size=d.get("routed_expert_hidden_size"),
            latent_moe_use_norm=bool(d.get("latent_moe_use_norm", True)),
            router_scoring=str(d.get("moe_router_activation_func", "sigmoid")),
            moe_renormalize=bool(d.get("moe_renormalize", d.get("norm_topk_prob", True))),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            use_correction_bias=topk_method == "noaux_tc",
            num_expert_group=groups,
            topk_group=kept,
            first_k_dense_replace=int(d.get("first_k_dense_replace", 1)),
            moe_layer_freq=int(d.get("moe_layer_freq", 1)),
            attn_res_block_size=d.get("attn_res_block_size"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            logit_scale=float(d.get("logit_scale", 1.0) or 1.0),
            max_position_embeddings=int(d.get("max_position_embeddings", 1048576)),
            expert_quant_format=_parse_quant(quant),
            extra=d,
        )


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _parse_layer_kinds(lin: Mapping[str, Any], n: int) -> tuple[LayerKind, ...]:
    kda, full = lin.get("kda_layers"), lin.get("full_attn_layers")
    if kda is None and full is None:
        return tuple("mla" for _ in range(n))
    if kda is None or full is None:
        raise ConfigError(
            "linear_attn_config needs both kda_layers and full_attn_layers (1-based lists)"
        )
    kinds: list[LayerKind | None] = [None] * n
    lists: tuple[tuple[str, Any, LayerKind], ...] = (
        ("kda_layers", kda, "kda"),
        ("full_attn_layers", full, "mla"),
    )
    for name, layers, kind in lists:
        for one_based in layers:
            if not 1 <= int(one_based) <= n:
                raise ConfigError(
                    f"{name} entry {one_based} is outside 1..{n} (the lists are 1-based)"
                )
            if kinds[int(one_based) - 1] is not None:
                raise ConfigError(
                    f"layer {one_based} (1-based) appears twice in the attention lists"
                )
            kinds[int(one_based) - 1] = kind
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise ConfigError(
            f"layers {missing} (1-based) are in neither kda_layers nor full_attn_layers"
        )
    return tuple(k for k in kinds if k is not None)


def _check_situ(d: Mapping[str, Any], act: str) -> None:
    """The MoE kernels bake in SiTU's released constants, so other values cannot be served."""
    if act != "situ":
        return
    beta = d.get("activation_situ_beta")
    beta = 1.0 if beta is None else float(beta)
    linear_beta = d.get("activation_situ_linear_beta")
    if (beta, None if linear_beta is None else float(linear_beta)) != (SITU_BETA, SITU_LINEAR_BETA):
        raise ConfigError(
            f"SiTU with beta={beta}, linear_beta={linear_beta} is not supported; the kernels "
            "implement "
            f"beta={SITU_BETA}, linear_beta={SITU_LINEAR_BETA}"
        )


def _parse_quant(quant: Any) -> str | None:
    """Only the routed experts are ever quantised in K3 (compressed-tensors MXFP4); the expert
    format is detected from the tensors themselves at load, so this is informational."""
    if not isinstance(quant, Mapping):
        return None
    fmt = str(quant.get("format", "")) or None
    groups = quant.get("config_groups")
    if fmt is None and isinstance(groups, Mapping):
        fmts = {
            str(g.get("format"))
            for g in groups.values()
            if isinstance(g, Mapping) and g.get("format")
        }
        fmt = fmts.pop() if len(fmts) == 1 else None
    if fmt is not None and "mxfp4" in fmt:
        return "mxfp4"
    return fmt
