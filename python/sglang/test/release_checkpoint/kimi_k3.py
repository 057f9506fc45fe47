"""Kimi K3 checkpoints in the layout Moonshot publishes:

- the multimodal wrapper's names: ``language_model.model.layers.N...``,
  ``language_model.model.embed_tokens.weight``, ``language_model.lm_head.weight``; MoE layers
  under ``block_sparse_moe`` (dense layers under ``mlp``);
- bf16 for every dense linear, norm, embedding, LM head, router and latent projection; fp32 for
  ``A_log`` (released as a ``[head_dim]`` vector; the engine reads the first ``num_heads``),
  ``dt_bias``, the short-conv weights, ``o_norm.weight`` and ``e_score_correction_bias``;
- routed experts only in compressed-tensors ``mxfp4-pack-quantized``:
  ``experts.E.wK.weight_packed`` uint8 ``[N, K/2]`` (two E2M1 a byte, low nibble = even
  element) and ``experts.E.wK.weight_scale`` uint8 ``[N, K/32]`` (the UE8M0 exponent byte);
- sharded safetensors with ``model.safetensors.index.json``; ``config.json`` is the wrapper
  (``model_type: kimi_k3``, the text model under ``text_config``) with the compressed-tensors
  ``quantization_config`` beside it.

Two ways in: :func:`write_from_tensors` quantises a state dict in release names (e.g.
:func:`from_model` of our ``KimiK3ForCausalLM``, the reference the tests use), and
:func:`write_random` draws every tensor. :func:`release_tensors` gives the same tensors in memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from sglang.test.release_checkpoint.emit import (
    ReleaseCheckpoint,
    ReleaseTensors,
    given_else_random,
    in_memory,
    random_source,
    write_checkpoint,
)
from sglang.test.release_checkpoint.layout import (
    EMBEDDING,
    FAN_IN,
    NORM,
    Format,
    Group,
    Init,
    Split,
    TensorSpec,
)

if TYPE_CHECKING:
    from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM

ExpertFormat = Literal["mxfp4", "bf16"]
PREFIX = "language_model."
BF16, FP32 = torch.bfloat16, torch.float32

# --- presets -------------------------------------------------------------------------------------

# What every preset keeps from the release: the SiTU and router settings, the latent MoE with its
# norm, NoPE MLA with the output gate, a dense first layer, KDA's conv and gates. The presets
# differ in widths and layer counts only.
RELEASE_SETTINGS: dict[str, Any] = {
    "model_type": "kimi_linear",
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-5,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_shared_experts": 2,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "topk_method": "noaux_tc",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "tie_word_embeddings": False,
}
KDA_RELEASE_SETTINGS: dict[str, Any] = {
    "short_conv_kernel_size": 4,
    "use_full_rank_gate": True,
    "gate_lower_bound": -5.0,
}

# The CPU tests' tiny model: K3's shape in miniature. 8 layers, AttnRes blocks of 3 (bank writes
# at layers 0, 3, 6), MLA at 1-based 4 and 8, dense layer 0, latent MoE with norm, safe gate,
# full-rank gates. Widths divisible by 32 (MXFP4 groups).
TINY_CONFIG: dict[str, Any] = {
    **RELEASE_SETTINGS,
    "vocab_size": 97,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "intermediate_size": 96,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 24,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_experts": 8,
    "num_experts_per_token": 3,
    "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 32,
    "attn_res_block_size": 3,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7],
        "full_attn_layers": [4, 8],
        "num_heads": 2,
        "head_dim": 16,
        **KDA_RELEASE_SETTINGS,
    },
}


def _mla_layers(layers: int) -> list[int]:
    """The release's schedule: MLA at every fourth layer (1-based) and the last, KDA elsewhere."""
    return sorted({i for i in range(1, layers + 1) if i % 4 == 0} | {layers})


def tiny_config(layers: int | None = None, num_experts: int | None = None) -> dict[str, Any]:
    """:data:`TINY_CONFIG`, optionally with ``layers`` layers (MLA at every fourth and the last)
    and ``num_experts`` routed experts (top-3 or fewer)."""
    out = dict(TINY_CONFIG)
    if layers is not None:
        mla = _mla_layers(layers)
        out["num_hidden_layers"] = layers
        out["linear_attn_config"] = {
            **TINY_CONFIG["linear_attn_config"],
            "kda_layers": [i for i in range(1, layers + 1) if i not in mla],
            "full_attn_layers": mla,
        }
    if num_experts is not None:
        out["num_experts"] = num_experts
        out["num_experts_per_token"] = min(3, num_experts)
    return out


def k3_config(
    layers: int = 4, *, num_experts: int = 896, vocab_size: int = 163840
) -> dict[str, Any]:
    """Kimi K3's widths for ``layers`` layers: hidden 7168, latent 3584, ``num_experts`` (896)
    experts of intermediate 3072 top-16 plus two shared, dense layer 0 of 33792, KDA 96 x 128
    (conv 4), MLA 96 heads (q rank 1536, kv rank 512, nope 128, rope 64, v 128) at every fourth
    layer (1-based) and the last, AttnRes blocks of 12."""
    mla = _mla_layers(layers)
    return {
        **RELEASE_SETTINGS,
        "architectures": ["KimiK3LinearForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 7168,
        "num_hidden_layers": layers,
        "intermediate_size": 33792,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_experts": num_experts,
        "num_experts_per_token": min(16, num_experts),
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "attn_res_block_size": 12,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, layers + 1) if i not in mla],
            "full_attn_layers": mla,
            "num_heads": 96,
            "head_dim": 128,
            **KDA_RELEASE_SETTINGS,
        },
        "max_position_embeddings": 1048576,
        "torch_dtype": "bfloat16",
    }


# --- config.json ---------------------------------------------------------------------------------

# compressed-tensors' description of MXFP4 routed experts (group 32, float 4-bit, symmetric,
# static), targeting the experts' linears only.
MXFP4_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "strategy": "group",
                "group_size": 32,
                "symmetric": True,
                "dynamic": False,
                "actorder": None,
                "block_structure": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": ["lm_head", "re:vision_tower.*", "re:mm_projector.*"],
    "kv_cache_scheme": None,
    "sparsity_config": {},
    "global_compression_ratio": None,
}


def release_config(text_config: Mapping[str, Any], *, experts: ExpertFormat = "mxfp4") -> dict:
    """The wrapper ``config.json``: ``KimiK3ForConditionalGeneration`` with the text model under
    ``text_config`` and, for MXFP4 experts, compressed-tensors' ``quantization_config``."""
    out: dict[str, Any] = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": {**text_config, "model_type": "kimi_linear"},
        "media_placeholder_token_id": 163605,
        "tie_word_embeddings": bool(text_config.get("tie_word_embeddings", False)),
        "torch_dtype": "bfloat16",
    }
    if experts == "mxfp4":
        out["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
    return out


# --- the tensors ---------------------------------------------------------------------------------


def _plain(
    name: str,
    shape: tuple[int, ...],
    split: Split,
    dtype: torch.dtype | None,
    init: Init = FAN_IN,
    group: Group = Group.DENSE_PLAIN,
) -> TensorSpec:
    return TensorSpec(name, shape, Format.PLAIN, group, split, init=init, dtype=dtype)


def _kinds(c: Mapping[str, Any]) -> list[str]:
    n = int(c["num_hidden_layers"])
    lin = c.get("linear_attn_config") or {}
    kda = {int(i) for i in lin.get("kda_layers") or ()}
    return ["kda" if i + 1 in kda else "mla" for i in range(n)]


def _is_moe(c: Mapping[str, Any], i: int) -> bool:
    first, freq = int(c.get("first_k_dense_replace", 1)), int(c.get("moe_layer_freq", 1))
    return int(c.get("num_experts", 0) or 0) > 0 and i >= first and i % freq == 0


def _kda_specs(p: str, c: Mapping[str, Any], dense: torch.dtype | None) -> list[TensorSpec]:
    h = int(c["hidden_size"])
    lin = c["linear_attn_config"]
    heads, d, k = int(lin["num_heads"]), int(lin["head_dim"]), int(lin["short_conv_kernel_size"])
    w = heads * d
    tp, rep = Split.TP, Split.REPLICATED
    specs = [_plain(f"{p}{x}_proj.weight", (w, h), tp, dense) for x in "qkv"]
    specs += [
        _plain(f"{p}{x}_conv1d.weight", (w, 1, k), tp, FP32, Init("normal", 0.0, 0.5))
        for x in "qkv"
    ]
    specs += [
        _plain(f"{p}f_a_proj.weight", (d, h), rep, dense),
        _plain(f"{p}f_b_proj.weight", (w, d), tp, dense),
        _plain(f"{p}b_proj.weight", (heads, h), tp, dense),
    ]
    if lin.get("use_full_rank_gate", False):
        specs.append(_plain(f"{p}g_proj.weight", (w, h), tp, dense))
    else:
        specs += [
            _plain(f"{p}g_a_proj.weight", (d, h), rep, dense),
            _plain(f"{p}g_b_proj.weight", (w, d), tp, dense),
        ]
    specs += [
        _plain(f"{p}A_log", (d,), rep, FP32, Init("normal", 0.0, 0.5), Group.SMALL),
        _plain(f"{p}dt_bias", (w,), tp, FP32, Init("normal", 0.0, 1.0), Group.SMALL),
        _plain(f"{p}o_norm.weight", (d,), rep, FP32, NORM, Group.SMALL),
        _plain(f"{p}o_proj.weight", (h, w), tp, dense),
    ]
    return specs


def _mla_specs(p: str, c: Mapping[str, Any], dense: torch.dtype | None) -> list[TensorSpec]:
    h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    kv_rank = int(c["kv_lora_rank"])
    tp, rep = Split.TP, Split.REPLICATED
    q_rank = c.get("q_lora_rank")
    if q_rank is None:
        specs = [_plain(f"{p}q_proj.weight", (heads * (nope + rope), h), tp, dense)]
    else:
        specs = [
            _plain(f"{p}q_a_proj.weight", (int(q_rank), h), rep, dense),
            _plain(f"{p}q_a_layernorm.weight", (int(q_rank),), rep, dense, NORM, Group.SMALL),
            _plain(f"{p}q_b_proj.weight", (heads * (nope + rope), int(q_rank)), tp, dense),
        ]
    specs += [
        _plain(f"{p}kv_a_proj_with_mqa.weight", (kv_rank + rope, h), rep, dense),
        _plain(f"{p}kv_a_layernorm.weight", (kv_rank,), rep, dense, NORM, Group.SMALL),
        _plain(f"{p}kv_b_proj.weight", (heads * (nope + v), kv_rank), tp, dense),
    ]
    if c.get("mla_use_output_gate", False):
        specs.append(_plain(f"{p}g_proj.weight", (heads * v, h), tp, dense))
    specs.append(_plain(f"{p}o_proj.weight", (h, heads * v), tp, dense))
    return specs


def _moe_specs(
    p: str, c: Mapping[str, Any], dense: torch.dtype | None, experts: ExpertFormat
) -> list[TensorSpec]:
    h, e = int(c["hidden_size"]), int(c["num_experts"])
    inter = int(c["moe_intermediate_size"])
    shared = inter * int(c.get("num_shared_experts", 0) or 0)
    latent = c.get("routed_expert_hidden_size")
    width = int(latent) if latent is not None else h
    rep = Split.REPLICATED
    specs = [_plain(f"{p}gate.weight", (e, h), rep, dense)]
    if c.get("topk_method", "noaux_tc") == "noaux_tc":
        bias = Init("normal", 0.0, 0.1)
        specs.append(_plain(f"{p}gate.e_score_correction_bias", (e,), rep, FP32, bias, Group.SMALL))
    if latent is not None:
        specs += [
            _plain(f"{p}routed_expert_down_proj.weight", (width, h), rep, dense),
            _plain(f"{p}routed_expert_up_proj.weight", (h, width), rep, dense),
        ]
        if c.get("latent_moe_use_norm", True):
            norm = f"{p}routed_expert_norm.weight"
            specs.append(_plain(norm, (width,), rep, dense, NORM, Group.SMALL))
    if shared:
        for proj, shape in (("gate", (shared, h)), ("up", (shared, h)), ("down", (h, shared))):
            name = f"{p}shared_experts.{proj}_proj.weight"
            specs.append(_plain(name, shape, Split.SHARED_EXPERT, dense))
    for proj, shape in (("w1", (inter, width)), ("w3", (inter, width)), ("w2", (width, inter))):
        stack = f"{p}experts.*.{proj}"
        for i in range(e):
            base = f"{p}experts.{i}.{proj}"
            if experts == "bf16":
                specs.append(
                    TensorSpec(
                        f"{base}.weight",
                        shape,
                        Format.PLAIN,
                        Group.EXPERTS,
                        Split.ROUTED_EXPERT,
                        dtype=dense,
                        stack=stack,
                    )
                )
            else:
                specs.append(
                    TensorSpec(
                        f"{base}.weight",
                        shape,
                        Format.MXFP4,
                        Group.EXPERTS,
                        Split.ROUTED_EXPERT,
                        stored_name=f"{base}.weight_packed",
                        scale_name=f"{base}.weight_scale",
                        scale_dtype=torch.uint8,
                        packed_dtype=torch.uint8,
                        stack=stack,
                    )
                )
    return specs


def _layer_specs(
    i: int, kind: str, c: Mapping[str, Any], dense: torch.dtype | None, experts: ExpertFormat
) -> list[TensorSpec]:
    h = int(c["hidden_size"])
    p = f"{PREFIX}model.layers.{i}."
    rep = Split.REPLICATED
    specs = [
        _plain(f"{p}input_layernorm.weight", (h,), rep, dense, NORM, Group.SMALL),
        _plain(f"{p}post_attention_layernorm.weight", (h,), rep, dense, NORM, Group.SMALL),
    ]
    if c.get("attn_res_block_size") is not None:
        for site in ("self_attention", "mlp"):
            specs += [
                _plain(f"{p}{site}_res_norm.weight", (h,), rep, dense, NORM, Group.SMALL),
                # scores of std ~2 whatever the width: the read mixes its rows, not picks one
                _plain(f"{p}{site}_res_proj.weight", (1, h), rep, dense, Init("fan_in", b=2.0)),
            ]
    attn = _kda_specs if kind == "kda" else _mla_specs
    specs += attn(f"{p}self_attn.", c, dense)
    if _is_moe(c, i):
        specs += _moe_specs(f"{p}block_sparse_moe.", c, dense, experts)
    else:
        inter = int(c["intermediate_size"])
        for proj, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
            specs.append(_plain(f"{p}mlp.{proj}_proj.weight", shape, Split.TP, dense))
    return specs


VISION_SPECS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("vision_tower.patch_embed.proj.weight", (32, 3 * 14 * 14)),
    ("mm_projector.proj.0.weight", (64, 32)),
)


def tensor_specs(
    config: Mapping[str, Any],
    *,
    experts: ExpertFormat = "mxfp4",
    dense_dtype: torch.dtype | None = BF16,
    vision: bool = False,
) -> Iterator[TensorSpec]:
    """Every tensor of the release checkpoint for text config ``config``, layer by layer.
    ``dense_dtype=None`` keeps each given tensor's dtype (an exact reload of an fp32 model);
    ``vision`` adds a few vision-tower / projector tensors (the text engine skips them)."""
    if experts not in ("mxfp4", "bf16"):
        raise ValueError(f"experts={experts!r} is not one of ('mxfp4', 'bf16')")
    c = config
    h, vocab = int(c["hidden_size"]), int(c["vocab_size"])
    rep = Split.REPLICATED
    embed = f"{PREFIX}model.embed_tokens.weight"
    yield _plain(embed, (vocab, h), rep, dense_dtype, EMBEDDING, Group.EMBEDDINGS)
    for i, kind in enumerate(_kinds(c)):
        yield from _layer_specs(i, kind, c, dense_dtype, experts)
    yield _plain(f"{PREFIX}model.norm.weight", (h,), rep, dense_dtype, NORM, Group.SMALL)
    if c.get("attn_res_block_size") is not None:
        yield _plain(
            f"{PREFIX}model.output_attn_res_norm.weight", (h,), rep, dense_dtype, NORM, Group.SMALL
        )
        proj = f"{PREFIX}model.output_attn_res_proj.weight"
        yield _plain(proj, (1, h), rep, dense_dtype, Init("fan_in", b=2.0))
    yield _plain(f"{PREFIX}lm_head.weight", (vocab, h), rep, dense_dtype, group=Group.EMBEDDINGS)
    if vision:
        for name, shape in VISION_SPECS:
            yield TensorSpec(
                name, shape, Format.PLAIN, Group.NOT_LOADED, Split.NOT_LOADED, dtype=BF16
            )


# --- our model -----------------------------------------------------------------------------------


def from_model(model: KimiK3ForCausalLM) -> dict[str, torch.Tensor]:
    """A (TP=1) model's weights under the release names, unquantised and in their own dtype:
    ``block_sparse_moe`` for MoE layers, routed experts per expert (``w13`` = [w1; w3]),
    ``A_log`` padded to the released ``[head_dim]`` (the padding is never read)."""
    from sglang.srt.models.kimi_k3_moe import KimiK3MoE

    c = model.config
    dtype = next(model.parameters()).dtype  # the model's dtype
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        release = _release_name(model, name)
        t = p.detach().clone()
        if name.endswith("A_log"):
            if t.shape[0] > c.kda_head_dim:
                raise ValueError(f"A_log of {t.shape[0]} heads does not fit [{c.kda_head_dim}]")
            t = torch.cat([t, torch.full((c.kda_head_dim - t.shape[0],), 7.0, dtype=t.dtype)])
        out[release] = t
    for i, layer in enumerate(model.decoder_layers):
        if not isinstance(layer.mlp, KimiK3MoE):
            continue
        w = layer.mlp.experts.weights
        if w is None:
            raise ValueError(f"layer {i}: the model's routed experts are not loaded")
        w13, w2 = w.dequantized(dtype)  # float experts: as stored
        inter = w13.shape[1] // 2
        pre = f"{PREFIX}model.layers.{i}.block_sparse_moe.experts"
        for e in range(w13.shape[0]):
            out[f"{pre}.{e}.w1.weight"] = w13[e, :inter].clone()
            out[f"{pre}.{e}.w3.weight"] = w13[e, inter:].clone()
            out[f"{pre}.{e}.w2.weight"] = w2[e].clone()
    return out


def _release_name(model: KimiK3ForCausalLM, name: str) -> str:
    """The release name of one of the model's parameter names (``from_model``'s rule)."""
    release = PREFIX + name
    if name.startswith("model.layers.") and model.config.is_moe(int(name.split(".")[2])):
        release = release.replace(".mlp.", ".block_sparse_moe.", 1)
    return release


def into_model(model: KimiK3ForCausalLM, values: Mapping[str, torch.Tensor]) -> None:
    """Set a (TP=1) model's weights to release-named ``values`` (e.g. a written checkpoint's
    dequantised values) by the naming rule alone, without the engine's loader: the inverse of
    :func:`from_model`, so a reference built this way does not share the loader's mapping."""
    from sglang.srt.layers.moe.expert_weights import ExpertWeights
    from sglang.srt.models.kimi_k3_moe import KimiK3MoE

    with torch.no_grad():
        for name, p in model.named_parameters():
            t = values[_release_name(model, name)]
            p.copy_(t[: p.shape[0]] if name.endswith("A_log") else t)  # A_log: [D] -> [H]
        for i, layer in enumerate(model.decoder_layers):
            if not isinstance(layer.mlp, KimiK3MoE):
                continue
            pre = f"{PREFIX}model.layers.{i}.block_sparse_moe.experts"
            n = int(model.config.num_experts)
            gate_up = [
                torch.cat([values[f"{pre}.{e}.w1.weight"], values[f"{pre}.{e}.w3.weight"]])
                for e in range(n)
            ]
            w13 = torch.stack(gate_up)
            w2 = torch.stack([values[f"{pre}.{e}.w2.weight"] for e in range(n)])
            dtype = next(model.parameters()).dtype
            layer.mlp.experts.load_weights(ExpertWeights(w13.to(dtype), w2.to(dtype)))


# --- writers -------------------------------------------------------------------------------------


def _num_experts(config: Mapping[str, Any]) -> int:
    return int(config.get("num_experts", 0) or 0)


def write_from_tensors(
    path: str | os.PathLike[str],
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    experts: ExpertFormat = "mxfp4",
    dense_dtype: torch.dtype | None = BF16,
    vision: bool = False,
    seed: int = 0,
    max_shard_bytes: int | None = None,
) -> ReleaseCheckpoint:
    """Quantise ``tensors`` (release names, unquantised, e.g. :func:`from_model`) into a release
    checkpoint at ``path``; ``values`` holds what each tensor stands for, under the same names
    (so ``load_weights(fresh_model, result.values)`` builds the reference). With ``vision``, a
    few vision-tower tensors are drawn at random from ``seed`` too."""
    specs = list(tensor_specs(config, experts=experts, dense_dtype=dense_dtype, vision=vision))
    return write_checkpoint(
        path,
        release_config(config, experts=experts),
        specs,
        given_else_random(tensors, specs, _is_vision, seed),
        num_experts=_num_experts(config),
        keep_values=True,
        max_shard_bytes=max_shard_bytes,
    )


def write_unquantised(
    path: str | os.PathLike[str], config: Mapping[str, Any], model: KimiK3ForCausalLM
) -> ReleaseCheckpoint:
    """``model``'s weights (:func:`from_model`) in the release layout with unquantised experts
    and every tensor in the model's own dtype, so loading it back is exact."""
    return write_from_tensors(path, config, from_model(model), experts="bf16", dense_dtype=None)


def _is_vision(name: str) -> bool:
    return not name.startswith(PREFIX)


def write_random(
    path: str | os.PathLike[str],
    config: Mapping[str, Any],
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    experts: ExpertFormat = "mxfp4",
    vision: bool = False,
    keep_values: bool = True,
    max_shard_bytes: int | None = None,
) -> ReleaseCheckpoint:
    """A release checkpoint for text config ``config`` with every tensor drawn at random on
    ``device`` (see :func:`sglang.test.release_checkpoint.emit.random_source`)."""
    specs = tensor_specs(config, experts=experts, vision=vision)
    return write_checkpoint(
        path,
        release_config(config, experts=experts),
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
    experts: ExpertFormat = "mxfp4",
    dense_dtype: torch.dtype | None = None,
    vision: bool = False,
    seed: int = 0,
) -> ReleaseTensors:
    """The release tensors of ``tensors`` in memory (dense tensors in their own dtype by
    default, so a reload is exact), for tests that load a name -> tensor mapping."""
    specs = list(tensor_specs(config, experts=experts, dense_dtype=dense_dtype, vision=vision))
    draw = given_else_random(tensors, specs, _is_vision, seed)
    return in_memory(specs, draw, num_experts=_num_experts(config))


def model_release_tensors(
    model: KimiK3ForCausalLM, *, experts: ExpertFormat = "mxfp4", vision: bool = False
) -> ReleaseTensors:
    """Our (TP=1) model as the release's tensors, in memory: dense tensors in the model's dtype,
    routed experts in ``experts``; ``values`` is what a load of them gives (the experts'
    MXFP4 round trip), so ``load_weights(fresh_model, result.values)`` is the reference."""
    return release_tensors(model.config.extra, from_model(model), experts=experts, vision=vision)
