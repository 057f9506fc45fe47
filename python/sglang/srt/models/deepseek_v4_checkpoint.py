"""How DeepSeek V4's checkpoint reads: its :class:`CheckpointRules` for the one checkpoint loop
(``models/deepseek_v4.py`` registers them with the model).

Every parameter of the model is looked up by its (release) name after mapping the checkpoint's
spelling (the names section below); each parameter's ``weight_loader`` checks the full shape and
keeps this rank's shard. Formats:
- dense weights: bf16/fp32, or FP8 e4m3 with a 128x128 block scale (``.scale``, UE8M0 or fp32;
  also ``weight_scale_inv``) for the layers the config's ``quantization_config`` declares FP8:
  kept FP8 (W8A8) with a bf16/fp16 model, dequantised to fp32 with an fp32 one (the exactness
  check, whose maths equals the dequantised checkpoint's); an FP8 tensor for a layer the config
  does not declare, or a float one for a layer it does, is refused;
- routed experts: per-expert ``w1``/``w2``/``w3`` (or transformers' stacked ``gate_up_proj`` /
  ``down_proj``) in bf16, FP8 128x128 or MXFP4 (packed bytes + UE8M0 scales per 32); only this
  rank's part is read and cut as stored, then kept as the layer's plan says
  (``layers/moe/expert_plan.py``; docs/quantization.md): MXFP4 stays packed, or becomes FP8 for
  DeepGEMM on Hopper, or DeepGEMM's MegaMoE layout as the only copy (``mega_moe_prep``), or fp32
  in the exactness-check mode.
A missing, mis-shaped or (with ``strict``) unexpected tensor raises :class:`WeightLoadError` naming
it. ``mtp.*`` tensors are skipped with one log line.

Names: checkpoint tensor names of DeepSeek V4 -> the model's parameter names.

The model's names are the official release names (``layers.L.attn.wq_a.weight``,
``layers.L.ffn.experts.E.w1.weight`` ...). Accepted spellings:
- the official release (no prefix; FP8 scales as ``.scale``);
- what transformers' ``save_pretrained`` writes: the release names under a ``model.`` prefix,
  except ``model.embed_tokens.weight``, ``head.weight``, ``model.hc_head.hc_{fn,base,scale}`` and
  the attention's KV norm written as ``attn.norm.weight``;
- transformers' in-memory names (``model.layers.L.self_attn.q_a_proj.weight``,
  ``mlp.experts.gate_up_proj`` ...), e.g. a raw ``state_dict()``; FP8 scales as
  ``weight_scale_inv``.
``mtp.*`` (the multi-token-prediction layer) maps to ``None``: it is not part of this model.
"""

from __future__ import annotations

import re

import torch

from sglang.srt.layers.moe.expert_weights import WeightFormat
from sglang.srt.layers.quantization.block_fp8 import BlockFp8Weight, WeightFormatError
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex, WeightLoadError
from sglang.srt.model_loader.checkpoint_loop import CheckpointRules
from sglang.srt.model_loader.expert_loading import FP8_DTYPES
from sglang.srt.model_loader.name_rules import name_rules, rename
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig

__all__ = ["WeightLoadError", "canonical_name", "checkpoint_rules"]


# --- names ------------------------------------------------------------------------------

_TOP_LEVEL = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}

# Applied in order to the part after ``layers.L.``; each maps one spelling onto the release one.
_LAYER_RULES = name_rules(
    (r"^self_attn\.", "attn."),
    (r"^mlp\.", "ffn."),
    (r"^input_layernorm\.", "attn_norm."),
    (r"^post_attention_layernorm\.", "ffn_norm."),
    (r"^(attn|ffn)_hc\.(fn|base|scale)$", r"hc_\1_\2"),
    (r"^attn\.sinks$", "attn.attn_sink"),
    (r"^attn\.compressor\.indexer\.scorer\.weights_proj\.", "attn.indexer.weights_proj."),
    (r"^attn\.compressor\.indexer\.q_b_proj\.", "attn.indexer.wq_b."),
    (r"^attn\.compressor\.indexer\.", "attn.indexer.compressor."),
    (r"compressor\.kv_proj\.", "compressor.wkv."),
    (r"compressor\.gate_proj\.", "compressor.wgate."),
    (r"compressor\.position_bias$", "compressor.ape"),
    (r"compressor\.kv_norm\.", "compressor.norm."),
    (r"^attn\.q_a_proj\.", "attn.wq_a."),
    (r"^attn\.q_b_proj\.", "attn.wq_b."),
    (r"^attn\.kv_proj\.", "attn.wkv."),
    (r"^attn\.o_a_proj\.", "attn.wo_a."),
    (r"^attn\.o_b_proj\.", "attn.wo_b."),
    (r"^attn\.q_a_norm\.", "attn.q_norm."),
    (r"^attn\.norm\.", "attn.kv_norm."),
    (r"^ffn\.gate\.e_score_correction_bias$", "ffn.gate.bias"),
    (r"^ffn\.(shared_experts|experts\.\d+)\.gate_proj\.", r"ffn.\1.w1."),
    (r"^ffn\.(shared_experts|experts\.\d+)\.up_proj\.", r"ffn.\1.w3."),
    (r"^ffn\.(shared_experts|experts\.\d+)\.down_proj\.", r"ffn.\1.w2."),
    (r"\.weight_scale_inv$", ".scale"),
)
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def canonical_name(name: str) -> str | None:
    """The model's name for checkpoint tensor ``name``; ``None`` for tensors to skip (MTP)."""
    name = name.removeprefix("model.")
    if name.startswith("mtp."):
        return None
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    m = _LAYER.match(name)
    if m is None:
        return re.sub(r"\.weight_scale_inv$", ".scale", name)
    return f"layers.{m.group(1)}.{rename(m.group(2), _LAYER_RULES)}"


# --- tensors ------------------------------------------------------------------------------


def _dense(index: CheckpointIndex, canon: str) -> torch.Tensor | BlockFp8Weight:
    """A dense weight; an FP8 one comes with its block scale, for the layer to keep FP8 (a
    bf16/fp16 model) or dequantise (fp32)."""
    w = index.get(canon)
    if w.dtype not in FP8_DTYPES:
        return w
    scale_name = (
        canon[: -len(".weight")] + ".scale" if canon.endswith(".weight") else canon + ".scale"
    )
    if not index.has(scale_name):
        raise WeightLoadError(
            f"FP8 tensor {index.ckpt_name(canon)!r} has no block scale {scale_name!r}"
        )
    try:
        return BlockFp8Weight(w, index.get(scale_name))
    except WeightFormatError as exc:
        raise WeightLoadError(f"{index.ckpt_name(scale_name)!r}: {exc}") from None


def _scale_suffixes(fmt: WeightFormat) -> tuple[str, ...]:
    # ``canonical_name`` already maps ``weight_scale_inv`` onto the release's ``.scale``.
    return (".scale",)


def _skip_reason(name: str) -> str:
    # canonical_name skips only the MTP layer
    return "MTP tensors (mtp.*): the multi-token-prediction layer is not loaded"


def checkpoint_rules(config: DeepseekV4ModelConfig) -> CheckpointRules:
    """DeepSeek V4's checkpoint: release names, FP8 dense weights (its hash-routing tables are
    buffers with their own loaders)."""
    return CheckpointRules(
        model_name="DeepSeek V4",
        canonical_name=canonical_name,
        skip_reason=_skip_reason,
        names_hint="names after mapping to the release naming",
        dense=_dense,
        scale_suffixes=_scale_suffixes,
        tied=("head.weight", "embed.weight") if config.tie_word_embeddings else None,
    )
