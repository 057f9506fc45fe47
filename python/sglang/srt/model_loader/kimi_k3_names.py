"""Checkpoint tensor names of Kimi K3 -> the model's parameter names.

The model's names are the text model's (``model.layers.N.self_attn.q_proj.weight``,
``model.layers.N.mlp.gate.weight``, ``lm_head.weight``). Accepted spellings:
- the released multimodal wrapper: ``language_model.model.layers.N...``,
  ``language_model.lm_head.weight``; MoE layers under ``block_sparse_moe``; MXFP4 experts as
  ``experts.E.wK.weight_packed`` / ``weight_scale``;
- the same without ``language_model.`` (the flat text checkpoint), and ``language_model.layers.N``
  (the wrapper's other spelling, mapped onto ``model.layers.N``);
- transformers' Kimi Linear spelling of the KDA gate (``self_attn.forget_gate.f_a_proj`` ...).
Vision tower and projector tensors map to ``None``: a text-only engine does not load them.
"""

from __future__ import annotations

import re

_VISION_PREFIXES = (
    "vision_tower.",
    "vision_model.",
    "mm_projector.",
    "multi_modal_projector.",
    "mm_proj.",
)
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.weight_packed$", ".weight"),
        (r"\.self_attn\.forget_gate\.", ".self_attn."),
    )
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def canonical_name(name: str) -> str | None:
    """The model's name for checkpoint tensor ``name``; ``None`` for tensors a text model skips."""
    if name.startswith(_VISION_PREFIXES):
        return None
    name = name.removeprefix("language_model.")
    if name.startswith(_VISION_PREFIXES):
        return None
    if not name.startswith(("model.", "lm_head.")):
        name = "model." + name
    for pattern, repl in _RULES:
        name = pattern.sub(repl, name)
    return name


def layer_of(canon: str) -> int | None:
    """The decoder layer a canonical name belongs to (``None`` for model-level tensors)."""
    m = _LAYER.match(canon)
    return None if m is None else int(m.group(1))
