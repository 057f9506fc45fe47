"""Checkpoint tensor names of DeepSeek V4 -> the model's parameter names.

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

_TOP_LEVEL = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}

# Applied in order to the part after ``layers.L.``; each maps one spelling onto the release one.
_LAYER_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
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
    rest = m.group(2)
    for pattern, repl in _LAYER_RULES:
        rest = pattern.sub(repl, rest)
    return f"layers.{m.group(1)}.{rest}"
