"""Load a Kimi K3 model from a directory (config.json + safetensors) or from named tensors.

Every parameter is looked up by its model name after mapping the checkpoint's spelling (see
``kimi_k3_names``); each parameter's ``weight_loader`` checks the full shape and keeps this rank's
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
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from sglang.srt.layers.build_spec import DEFAULT_BUILD_SPEC, LayerBuildSpec
from sglang.srt.layers.moe.expert_weights import WeightFormat
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex, WeightLoadError
from sglang.srt.model_loader.checkpoint_loop import (
    CheckpointRules,
    LoadReport,
    load_checkpoint,
    load_model_dir,
)
from sglang.srt.model_loader.expert_loading import FP8_DTYPES
from sglang.srt.model_loader.kimi_k3_names import canonical_name, layer_of
from sglang.srt.model_loader.load_options import DEFAULT_LOAD_OPTIONS, LoadOptions
from sglang.srt.model_loader.weight_source import WeightSource, as_weight_source
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_config import KimiK3Config

__all__ = ["WeightLoadError", "checkpoint_rules", "load_kimi_k3", "load_weights"]


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


def checkpoint_rules(model: KimiK3ForCausalLM) -> CheckpointRules:
    """Kimi K3's checkpoint: the multimodal wrapper's names, text layers only, quantised experts
    only."""
    c = model.config
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


def load_weights(
    model: KimiK3ForCausalLM,
    source: WeightSource | Mapping[str, torch.Tensor],
    opts: LoadOptions = DEFAULT_LOAD_OPTIONS,
) -> LoadReport:
    """Fill ``model`` from ``source`` (a :class:`WeightSource` or a name -> tensor mapping);
    returns what is resident against the checkpoint bytes of this rank's share."""
    return load_checkpoint(model, as_weight_source(source), checkpoint_rules(model), opts)


def load_kimi_k3(
    model_dir: str | os.PathLike[str],
    spec: LayerBuildSpec = DEFAULT_BUILD_SPEC,
    opts: LoadOptions = DEFAULT_LOAD_OPTIONS,
) -> KimiK3ForCausalLM:
    """config.json + safetensors in ``model_dir`` -> a ready model (this rank's shard)."""
    model = KimiK3ForCausalLM(KimiK3Config.from_json_file(model_dir), spec)
    return load_model_dir(model, model_dir, checkpoint_rules(model), opts)
