"""How Kimi K3's checkpoint reads: its :class:`CheckpointRules` for the one checkpoint loop
(``models/kimi_k3.py`` registers them with the model).

Every parameter is looked up by its model name after mapping the checkpoint's spelling (the names
section below); each parameter's ``weight_loader`` checks the full shape and keeps this rank's
shard (TP: heads / intermediate rows; fp32 KDA tensors stay fp32). Routed experts:
- per-expert ``experts.E.w1|w2|w3`` in bf16, MXFP4 (compressed-tensors: ``weight_packed`` two
  E2M1 values a byte + ``weight_scale`` one UE8M0 byte per 32), or FP8 with 128x128 block scales
  (``weight_scale_inv``), or transformers' stacked ``gate_up_proj`` / ``down_proj``;
- only this rank's part is read and cut *as stored* (TP: a slice of the intermediate dim; MegaMoE:
  whole experts), stacked as ``w13 = [w1; w3]`` and kept as the layer's plan says
  (``layers/moe/expert_plan.py``, docs/quantization.md): MXFP4 stays packed for the SiTU
  runners, becomes ``fp8_fp4_mega_moe``'s layout as the only copy on Blackwell MegaMoE, or fp32
  in the exactness-check mode.
A missing, mis-shaped, wrongly typed or (with ``strict``) unexpected tensor raises
:class:`WeightLoadError` naming it. Vision tensors, and layers past ``num_hidden_layers`` (MTP),
are skipped with one log line.

Names: checkpoint tensor names of Kimi K3 -> the model's parameter names.

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

import torch

from sglang.srt.layers.moe.expert_weights import WeightFormat
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex, WeightLoadError
from sglang.srt.model_loader.checkpoint_loop import CheckpointRules
from sglang.srt.model_loader.expert_loading import FP8_DTYPES
from sglang.srt.model_loader.name_rules import name_rules, rename
from sglang.srt.models.kimi_k3_config import KimiK3Config

__all__ = ["WeightLoadError", "canonical_name", "checkpoint_rules"]


# --- names ------------------------------------------------------------------------------

_VISION_PREFIXES = (
    "vision_tower.",
    "vision_model.",
    "mm_projector.",
    "multi_modal_projector.",
    "mm_proj.",
)
_RULES = name_rules(
    (r"\.block_sparse_moe\.", ".mlp."),
    (r"\.weight_packed$", ".weight"),
    (r"\.self_attn\.forget_gate\.", ".self_attn."),
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
    return rename(name, _RULES)


def layer_of(canon: str) -> int | None:
    """The decoder layer a canonical name belongs to (``None`` for model-level tensors)."""
    m = _LAYER.match(canon)
    return None if m is None else int(m.group(1))


# --- tensors ------------------------------------------------------------------------------


def _dense(index: CheckpointIndex, canon: str) -> torch.Tensor:
    tensor = index.get(canon)
    if not tensor.dtype.is_floating_point or tensor.dtype in FP8_DTYPES:
        raise WeightLoadError(
            f"tensor {index.ckpt_name(canon)!r} is {tensor.dtype}: "
            "only the routed experts may be quantised"
        )
    return tensor


def _scale_suffixes(fmt: WeightFormat) -> tuple[str, ...]:
    # compressed-tensors names MXFP4 scales ``weight_scale``; FP8 block scales come either way.
    if fmt is WeightFormat.MXFP4:
        return (".weight_scale",)
    return (".weight_scale_inv", ".weight_scale")


def checkpoint_rules(config: KimiK3Config) -> CheckpointRules:
    """Kimi K3's checkpoint: the multimodal wrapper's names, text layers only, quantised experts
    only."""
    c = config
    num_layers = c.num_hidden_layers

    def in_model(name: str) -> str | None:
        canon = canonical_name(name)
        layer = None if canon is None else layer_of(canon)
        return None if layer is not None and layer >= num_layers else canon

    def skip_reason(name: str) -> str:
        # The two reasons to skip, told apart for the log: no text-model name, or a layer past ours.
        if canonical_name(name) is None:
            return "vision tower / projector tensors: text-only model"
        return f"tensors of layers >= num_hidden_layers={num_layers} (e.g. MTP)"

    return CheckpointRules(
        model_name="Kimi K3",
        canonical_name=in_model,
        skip_reason=skip_reason,
        names_hint=(
            "model names; the checkpoint may spell them language_model.model.layers.N..., with "
            "block_sparse_moe for mlp"
        ),
        dense=_dense,
        scale_suffixes=_scale_suffixes,
        tied=("lm_head.weight", "model.embed_tokens.weight") if c.tie_word_embeddings else None,
    )
