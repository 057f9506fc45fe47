"""DeepSeek V4 checkpoints in the layout DeepSeek publishes:

- release names (``embed.weight``, ``layers.L.attn.wq_a.weight``, ``layers.L.ffn.experts.E.w1``,
  ``hc_head_fn`` ...), no ``model.`` prefix;
- dense attention / shared-expert / MTP projection weights in FP8 e4m3 with one power-of-two
  scale per 128x128 tile, stored as ``<name>.scale`` in ``float8_e8m0fnu`` (or, as some exports
  do, ``<name>.weight_scale_inv`` in fp32: ``scale_format="fp32"``);
- routed experts in MXFP4: ``w1``/``w3`` ``[I, H/2]`` and ``w2`` ``[H, I/2]`` packed int8 bytes
  (low nibble = even element) with ``.scale`` ``float8_e8m0fnu`` ``[.., K/32]`` (or FP8 128x128
  blocks, ``experts="fp8"``, or unquantised, ``experts="bf16"``);
- bf16: embeddings, LM head, RMSNorm weights, router gate, compressor ``wkv``/``wgate``, indexer
  ``weights_proj``; fp32: every ``hc_*``, ``attn_sink``, ``gate.bias``, compressor ``ape`` and
  ``norm``; int32 ``ffn.gate.tid2eid [vocab, top_k]`` on the hash-routed layers;
- an ``mtp.0.*`` layer (a ratio-0 decoder layer with ``e_proj``/``h_proj``, ``enorm``/``hnorm``/
  ``norm`` and its own ``hc_head_*``), which the engine's loader skips;
- sharded safetensors with ``model.safetensors.index.json``, and ``config.json`` with one
  compress ratio per layer plus one for the MTP layer, ``num_nextn_predict_layers: 1`` and
  ``quantization_config`` ``{quant_method: fp8, fmt: e4m3, scale_fmt: ue8m0,
  weight_block_size: [128, 128], activation_scheme: dynamic}``.

Two ways in: :func:`write_from_tensors` quantises a state dict in release names (e.g.
:func:`from_transformers` of a transformers ``DeepseekV4ForCausalLM``; :func:`to_transformers`
maps the written checkpoint's dequantised values back), :func:`write_random` draws every tensor.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from sglang.test.release_checkpoint.emit import (
    ReleaseCheckpoint,
    ReleaseTensors,
    given_else_random,
    given_source,
    in_memory,
    random_source,
    write_checkpoint,
)
from sglang.test.release_checkpoint.layout import (
    EMBEDDING,
    FAN_IN,
    MHC_SCALE,
    NORM,
    VECTOR,
    Format,
    Group,
    Init,
    Split,
    TensorSpec,
)

DenseFormat = Literal["fp8", "bf16"]
ExpertFormat = Literal["mxfp4", "fp8", "bf16"]
ScaleFormat = Literal["ue8m0", "fp32"]
BF16, FP32 = torch.bfloat16, torch.float32

# --- presets -------------------------------------------------------------------------------------

# The CPU tests' tiny model: ratios 0/4/128, one hash layer, YaRN on the compressed layers,
# window 8, top-4 of the indexer. FP8 tiles and MXFP4 groups need no special widths (partial
# tiles get their own scale), but MXFP4 needs hidden and intermediate divisible by 32.
TINY_BASE: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 16,
    "o_groups": 2,
    "o_lora_rank": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    # 16 indexer heads: an entry scores exactly 0 (a tie) only if all 16 ReLUs clip, so
    # transformers' topk and our stable sort (ties -> earlier entry) pick the same entries.
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 4,
    "sliding_window": 8,
    "max_position_embeddings": 4096,
}
TINY_CONFIG: dict[str, Any] = dict(
    TINY_BASE,
    num_hidden_layers=3,
    compress_ratios=[0, 4, 128],
    num_hash_layers=1,
    rope_scaling={
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


def tiny_config(layers: int | None = None, num_experts: int | None = None) -> dict[str, Any]:
    """:data:`TINY_CONFIG`, optionally with ``layers`` layers (ratios cycling 0 / 4 / 128, the
    first hash-routed) and ``num_experts`` routed experts (top-2 or fewer)."""
    out = dict(TINY_CONFIG)
    if layers is not None:
        out["num_hidden_layers"] = layers
        out["compress_ratios"] = [(0, 4, 128)[i % 3] for i in range(layers)]
        out["num_hash_layers"] = min(1, layers)
    if num_experts is not None:
        out["n_routed_experts"] = num_experts
        out["num_experts_per_tok"] = min(2, num_experts)
    return out


def flash_config(
    ratios: Sequence[int],
    *,
    num_hash_layers: int = 1,
    n_routed_experts: int = 256,
    vocab_size: int = 129280,
    max_position_embeddings: int = 65536,
) -> dict[str, Any]:
    """DeepSeek V4-Flash's widths with one layer per entry of ``ratios`` (0, 4 or 128): hidden
    4096, ``n_routed_experts`` (256) routed experts top-6 of intermediate 2048 plus one shared,
    64 heads of 512 (rope 64, q rank 1024, 8 output groups of rank 1024), window 128, indexer
    64 heads of 128 top-512; the rest as the release has it (:data:`RELEASE_DEFAULTS`)."""
    return {
        **RELEASE_DEFAULTS,
        "vocab_size": vocab_size,
        "hidden_size": 4096,
        "num_hidden_layers": len(ratios),
        "num_attention_heads": 64,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "n_routed_experts": n_routed_experts,
        "num_experts_per_tok": min(6, n_routed_experts),
        "moe_intermediate_size": 2048,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "compress_ratios": list(ratios),
        "num_hash_layers": num_hash_layers,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


def flash_ratios(layers: int) -> list[int]:
    """Compression ratios alternating 4 / 128 (every layer compressed, both kinds present)."""
    return [(4, 128)[i % 2] for i in range(layers)]


# --- config.json ---------------------------------------------------------------------------------

# Keys the release's config.json carries that a test config may leave out, with the values
# transformers' DeepseekV4Config also defaults to (so a reference built from the same dict agrees).
RELEASE_DEFAULTS: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "num_hash_layers": 3,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "sliding_window": 128,
    "max_position_embeddings": 1048576,
    "tie_word_embeddings": False,
}
FP8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}


def release_config(
    config: Mapping[str, Any], *, dense: DenseFormat = "fp8", mtp: bool = True
) -> dict[str, Any]:
    """``config.json`` as the release writes it: the release keys, one compress ratio per layer
    plus one (0) for the MTP layer, ``num_nextn_predict_layers`` and, for FP8 dense weights,
    ``quantization_config``."""
    out = {**RELEASE_DEFAULTS, **config}
    ratios = _ratios(out)
    out["compress_ratios"] = ratios + [0] if mtp else ratios
    out["num_nextn_predict_layers"] = 1 if mtp else 0
    if dense == "fp8":
        out["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    else:
        out.pop("quantization_config", None)
    return out


def _ratios(config: Mapping[str, Any]) -> list[int]:
    """The per-layer compress ratios (the release's ``compress_ratios``; a trailing MTP entry is
    dropped)."""
    n = int(config["num_hidden_layers"])
    ratios = list(config.get("compress_ratios") or ())[:n]
    if len(ratios) != n:
        raise ValueError(
            f"the release layout needs compress_ratios with one ratio per layer ({n}), got "
            f"{config.get('compress_ratios')}"
        )
    return ratios


# --- the tensors ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Formats:
    dense: DenseFormat
    experts: ExpertFormat
    scale: ScaleFormat
    plain: torch.dtype | None  # the release's bf16 tensors (None: each given tensor's dtype)

    def __post_init__(self) -> None:
        for what, value, allowed in (
            ("dense", self.dense, ("fp8", "bf16")),
            ("experts", self.experts, ("mxfp4", "fp8", "bf16")),
            ("scale_format", self.scale, ("ue8m0", "fp32")),
        ):
            if value not in allowed:
                raise ValueError(f"{what}={value!r} is not one of {allowed}")

    @property
    def fp32(self) -> torch.dtype | None:
        return None if self.plain is None else FP32

    def fp8_scale(self, name: str) -> tuple[str, torch.dtype]:
        base = name.removesuffix(".weight")
        if self.scale == "fp32":
            return base + ".weight_scale_inv", torch.float32
        return base + ".scale", torch.float8_e8m0fnu

    def dense_spec(self, name: str, shape: tuple[int, ...], split: Split) -> TensorSpec:
        if self.dense == "bf16":
            return TensorSpec(name, shape, Format.PLAIN, Group.DENSE_PLAIN, split, dtype=self.plain)
        scale, dtype = self.fp8_scale(name)
        return TensorSpec(
            name,
            shape,
            Format.FP8_BLOCK,
            Group.DENSE_FP8,
            split,
            scale_name=scale,
            scale_dtype=dtype,
        )

    def expert_spec(self, name: str, shape: tuple[int, ...], stack: str) -> TensorSpec:
        split = Split.ROUTED_EXPERT
        if self.experts == "bf16":
            return TensorSpec(
                name, shape, Format.PLAIN, Group.EXPERTS, split, dtype=self.plain, stack=stack
            )
        scale = name.removesuffix(".weight") + ".scale"
        if self.experts == "fp8":
            scale, dtype = self.fp8_scale(name)
            fmt, packed = Format.FP8_BLOCK, torch.uint8
        else:
            dtype, fmt, packed = torch.float8_e8m0fnu, Format.MXFP4, torch.int8
        return TensorSpec(
            name,
            shape,
            fmt,
            Group.EXPERTS,
            split,
            scale_name=scale,
            scale_dtype=dtype,
            packed_dtype=packed,
            stack=stack,
        )


def _small(
    name: str,
    shape: tuple[int, ...],
    init: Init,
    dtype: torch.dtype | None,
    split: Split = Split.REPLICATED,
) -> TensorSpec:
    return TensorSpec(name, shape, Format.PLAIN, Group.SMALL, split, init=init, dtype=dtype)


def _plain(name: str, shape: tuple[int, ...], f: _Formats) -> TensorSpec:
    return TensorSpec(name, shape, Format.PLAIN, Group.DENSE_PLAIN, Split.REPLICATED, dtype=f.plain)


def _mhc(prefix: str, rows: int, width: int, extra: int, f: _Formats) -> list[TensorSpec]:
    """One mHC parameter triplet: ``fn [rows, width]``, ``base [rows]``, ``scale [extra]``."""
    return [
        _small(f"{prefix}fn", (rows, width), FAN_IN, f.fp32),
        _small(f"{prefix}base", (rows,), VECTOR, f.fp32),
        _small(f"{prefix}scale", (extra,), MHC_SCALE, f.fp32),
    ]


def _compressor(prefix: str, h: int, dim: int, ratio: int, f: _Formats) -> list[TensorSpec]:
    width = dim * (2 if ratio == 4 else 1)  # ratio 4 overlaps two blocks
    return [
        _plain(f"{prefix}wkv.weight", (width, h), f),
        _plain(f"{prefix}wgate.weight", (width, h), f),
        _small(f"{prefix}ape", (ratio, width), FAN_IN, f.fp32),
        _small(f"{prefix}norm.weight", (dim,), NORM, f.fp32),
    ]


def _layer_specs(
    prefix: str, c: Mapping[str, Any], ratio: int, hashed: bool, f: _Formats
) -> list[TensorSpec]:
    h, hc = int(c["hidden_size"]), int(c.get("hc_mult", 4))
    heads, hd = int(c["num_attention_heads"]), int(c["head_dim"])
    q_rank, groups, o_rank = int(c["q_lora_rank"]), int(c["o_groups"]), int(c["o_lora_rank"])
    experts, inter = int(c["n_routed_experts"]), int(c["moe_intermediate_size"])
    shared = inter * int(c.get("n_shared_experts", 1))
    mix = (2 + hc) * hc
    a = f"{prefix}attn."
    specs = [
        *_mhc(f"{prefix}hc_attn_", mix, hc * h, 3, f),
        *_mhc(f"{prefix}hc_ffn_", mix, hc * h, 3, f),
        _small(f"{prefix}attn_norm.weight", (h,), NORM, f.plain),
        _small(f"{prefix}ffn_norm.weight", (h,), NORM, f.plain),
        f.dense_spec(f"{a}wq_a.weight", (q_rank, h), Split.REPLICATED),
        _small(f"{a}q_norm.weight", (q_rank,), NORM, f.plain),
        f.dense_spec(f"{a}wq_b.weight", (heads * hd, q_rank), Split.TP),
        f.dense_spec(f"{a}wkv.weight", (hd, h), Split.REPLICATED),
        _small(f"{a}kv_norm.weight", (hd,), NORM, f.plain),
        f.dense_spec(f"{a}wo_a.weight", (groups * o_rank, heads * hd // groups), Split.TP),
        f.dense_spec(f"{a}wo_b.weight", (h, groups * o_rank), Split.TP),
        _small(f"{a}attn_sink", (heads,), VECTOR, f.fp32, Split.TP),
    ]
    if ratio:
        specs += _compressor(f"{a}compressor.", h, hd, ratio, f)
    if ratio == 4:
        ih, idim = int(c.get("index_n_heads", 64)), int(c.get("index_head_dim", 128))
        specs += [
            f.dense_spec(f"{a}indexer.wq_b.weight", (ih * idim, q_rank), Split.REPLICATED),
            _plain(f"{a}indexer.weights_proj.weight", (ih, h), f),
            *_compressor(f"{a}indexer.compressor.", h, idim, 4, f),
        ]
    g = f"{prefix}ffn."
    specs.append(_plain(f"{g}gate.weight", (experts, h), f))
    if hashed:
        top_k = int(c["num_experts_per_tok"])
        specs.append(
            TensorSpec(
                f"{g}gate.tid2eid",
                (int(c["vocab_size"]), top_k),
                Format.INDEX,
                Group.HASH_TABLES,
                Split.REPLICATED,
                init=Init("hash", experts, top_k),
                dtype=torch.int32,
            )
        )
    else:
        specs.append(_small(f"{g}gate.bias", (experts,), VECTOR, f.fp32))
    for proj, shape in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
        stack = f"{g}experts.*.{proj}"
        specs += [
            f.expert_spec(f"{g}experts.{e}.{proj}.weight", shape, stack) for e in range(experts)
        ]
    for proj, shape in (("w1", (shared, h)), ("w3", (shared, h)), ("w2", (h, shared))):
        specs.append(f.dense_spec(f"{g}shared_experts.{proj}.weight", shape, Split.SHARED_EXPERT))
    return specs


def _not_loaded(spec: TensorSpec) -> TensorSpec:
    return dataclasses.replace(spec, group=Group.NOT_LOADED, split=Split.NOT_LOADED)


def _mtp_specs(c: Mapping[str, Any], f: _Formats) -> list[TensorSpec]:
    h, hc = int(c["hidden_size"]), int(c.get("hc_mult", 4))
    p = "mtp.0."
    specs = [
        f.dense_spec(f"{p}e_proj.weight", (h, h), Split.REPLICATED),
        f.dense_spec(f"{p}h_proj.weight", (h, h), Split.REPLICATED),
        _small(f"{p}enorm.weight", (h,), NORM, f.plain),
        _small(f"{p}hnorm.weight", (h,), NORM, f.plain),
        _small(f"{p}norm.weight", (h,), NORM, f.plain),
        *_mhc(f"{p}hc_head_", hc, hc * h, 1, f),
        *_layer_specs(p, c, ratio=0, hashed=False, f=f),
    ]
    return [_not_loaded(s) for s in specs]


def tensor_specs(
    config: Mapping[str, Any],
    *,
    dense: DenseFormat = "fp8",
    experts: ExpertFormat = "mxfp4",
    scale_format: ScaleFormat = "ue8m0",
    mtp: bool = True,
    plain_dtype: torch.dtype | None = BF16,
) -> Iterator[TensorSpec]:
    """Every tensor of the release checkpoint for ``config``, layer by layer. ``plain_dtype``
    is the dtype of the release's bf16 tensors (fp32 ones stay fp32); ``None`` keeps every
    given unquantised tensor's dtype (an exact reload of an fp32 reference)."""
    f = _Formats(dense, experts, scale_format, plain_dtype)
    c = {**RELEASE_DEFAULTS, **config}
    h, hc, vocab = int(c["hidden_size"]), int(c["hc_mult"]), int(c["vocab_size"])
    n, hashed = int(c["num_hidden_layers"]), int(c["num_hash_layers"])
    ratios = _ratios(c)
    yield TensorSpec(
        "embed.weight",
        (vocab, h),
        Format.PLAIN,
        Group.EMBEDDINGS,
        Split.REPLICATED,
        init=EMBEDDING,
        dtype=f.plain,
    )
    for i in range(n):
        yield from _layer_specs(f"layers.{i}.", c, ratios[i], i < hashed, f)
    if mtp:
        yield from _mtp_specs(c, f)
    yield _small("norm.weight", (h,), NORM, f.plain)
    yield from _mhc("hc_head_", hc, hc * h, 1, f)
    yield TensorSpec(
        "head.weight", (vocab, h), Format.PLAIN, Group.EMBEDDINGS, Split.REPLICATED, dtype=f.plain
    )


# --- transformers names --------------------------------------------------------------------------

# release name after ``layers.L.`` -> transformers' in-memory name after ``model.layers.L.``
_LAYER_NAMES: dict[str, str] = {
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_TOP_NAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_HF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_HF_TOP_NAMES = {v: k for k, v in _TOP_NAMES.items()}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def from_transformers(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers ``DeepseekV4ForCausalLM`` state dict in release names (unquantised, same
    dtypes; stacked experts split per expert, ``gate_up_proj`` = [w1; w3]; ``tid2eid`` int32)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name in _HF_TOP_NAMES:
            out[_HF_TOP_NAMES[name]] = t
            continue
        m = _HF_LAYER.match(name)
        if m is None:
            raise ValueError(f"no release name for transformers tensor {name!r}")
        layer, rest = m.groups()
        if rest == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.w1.weight"] = t[e, :inter]
                out[f"layers.{layer}.ffn.experts.{e}.w3.weight"] = t[e, inter:]
        elif rest == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.w2.weight"] = t[e]
        elif rest in _HF_LAYER_NAMES:
            release = f"layers.{layer}.{_HF_LAYER_NAMES[rest]}"
            out[release] = t.to(torch.int32) if rest.endswith("tid2eid") else t
        else:
            raise ValueError(f"no release name for transformers tensor {name!r}")
    return {k: v.contiguous() for k, v in out.items()}


def to_transformers(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Release-named values (e.g. a written checkpoint's dequantised ``values``) in transformers'
    names, experts stacked, for ``DeepseekV4ForCausalLM.load_state_dict``; the MTP layer, which
    transformers does not build, is dropped."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in values.items():
        if name.startswith("mtp."):
            continue
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = t
            continue
        e = _EXPERT.match(name)
        if e is not None:
            experts.setdefault((e.group(1), e.group(3)), {})[int(e.group(2))] = t
            continue
        m = _LAYER.match(name)
        if m is None or m.group(2) not in _LAYER_NAMES:
            raise ValueError(f"no transformers name for release tensor {name!r}")
        layer, rest = m.groups()
        hf = _LAYER_NAMES[rest]
        out[f"model.layers.{layer}.{hf}"] = t.long() if rest.endswith("tid2eid") else t
    for layer in sorted({key[0] for key in experts}):
        w1, w3, w2 = (experts[(layer, p)] for p in ("w1", "w3", "w2"))
        ids = range(len(w1))
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w1[i], w3[i]]) for i in ids]
        )
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([w2[i] for i in ids])
    return out


# --- writers -------------------------------------------------------------------------------------


def _num_experts(config: Mapping[str, Any]) -> int:
    return int(config["n_routed_experts"])


def write_from_tensors(
    path: str | os.PathLike[str],
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    dense: DenseFormat = "fp8",
    experts: ExpertFormat = "mxfp4",
    scale_format: ScaleFormat = "ue8m0",
    mtp: bool = True,
    plain_dtype: torch.dtype | None = BF16,
    seed: int = 0,
    max_shard_bytes: int | None = None,
) -> ReleaseCheckpoint:
    """Quantise ``tensors`` (release names, unquantised, e.g. :func:`from_transformers`) into a
    release checkpoint at ``path``. With ``mtp``, MTP tensors missing from ``tensors`` (a
    reference model has none) are drawn at random from ``seed``. The result's ``values`` hold
    what every tensor stands for (``to_transformers`` maps them onto a reference model);
    ``plain_dtype=None`` keeps the unquantised tensors' own dtype instead of the release's bf16."""
    specs = list(
        tensor_specs(
            config,
            dense=dense,
            experts=experts,
            scale_format=scale_format,
            mtp=mtp,
            plain_dtype=plain_dtype,
        )
    )

    def drawn_at_random(name: str) -> bool:
        return _is_mtp(name) and name not in tensors

    return write_checkpoint(
        path,
        release_config(config, dense=dense, mtp=mtp),
        specs,
        given_else_random(tensors, specs, drawn_at_random, seed),
        num_experts=_num_experts(config),
        keep_values=True,
        max_shard_bytes=max_shard_bytes,
    )


def _is_mtp(name: str) -> bool:
    return name.startswith("mtp.")


def write_random(
    path: str | os.PathLike[str],
    config: Mapping[str, Any],
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dense: DenseFormat = "fp8",
    experts: ExpertFormat = "mxfp4",
    scale_format: ScaleFormat = "ue8m0",
    mtp: bool = True,
    keep_values: bool = True,
    max_shard_bytes: int | None = None,
) -> ReleaseCheckpoint:
    """A release checkpoint for ``config`` with every tensor drawn at random on ``device``
    (matrices N(0, 1/fan_in) with a 2^U(-1, 1) factor per quantisation block, norm weights
    U(0.5, 1.5), mHC scales around 1, hash tables of distinct experts). A real width is drawn
    and quantised on the GPU; pass ``keep_values=False`` not to keep its fp32 values."""
    specs = tensor_specs(config, dense=dense, experts=experts, scale_format=scale_format, mtp=mtp)
    return write_checkpoint(
        path,
        release_config(config, dense=dense, mtp=mtp),
        specs,
        random_source(seed, device),
        num_experts=_num_experts(config),
        keep_values=keep_values,
        max_shard_bytes=max_shard_bytes,
    )


def release_tensors(
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    dense: DenseFormat = "fp8",
    experts: ExpertFormat = "mxfp4",
    scale_format: ScaleFormat = "ue8m0",
    plain_dtype: torch.dtype | None = BF16,
) -> ReleaseTensors:
    """The quantised release tensors of ``tensors`` in memory (no MTP layer), for tests that
    load a name -> tensor mapping or write an edited copy (``shards.save_sharded``)."""
    specs = list(
        tensor_specs(
            config,
            dense=dense,
            experts=experts,
            scale_format=scale_format,
            mtp=False,
            plain_dtype=plain_dtype,
        )
    )
    return in_memory(specs, given_source(tensors, specs), num_experts=_num_experts(config))
