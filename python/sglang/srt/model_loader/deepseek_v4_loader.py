"""Load a DeepSeek V4 model from a directory (config.json + safetensors) or from named tensors.

Every parameter of the model is looked up by its (release) name after mapping the checkpoint's
spelling (see ``deepseek_v4_names``); each parameter's ``weight_loader`` checks the full shape and
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
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from sglang.srt.layers.build_spec import DEFAULT_BUILD_SPEC, LayerBuildSpec
from sglang.srt.layers.moe.expert_weights import WeightFormat
from sglang.srt.layers.quantization.block_fp8 import BlockFp8Weight, WeightFormatError
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex, WeightLoadError
from sglang.srt.model_loader.checkpoint_loop import (
    CheckpointRules,
    LoadReport,
    load_checkpoint,
    load_model_dir,
)
from sglang.srt.model_loader.deepseek_v4_names import canonical_name
from sglang.srt.model_loader.expert_loading import FP8_DTYPES
from sglang.srt.model_loader.load_options import DEFAULT_LOAD_OPTIONS, LoadOptions
from sglang.srt.model_loader.weight_source import WeightSource, as_weight_source
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig

__all__ = ["WeightLoadError", "checkpoint_rules", "load_deepseek_v4", "load_weights"]


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


def checkpoint_rules(model: DeepseekV4ForCausalLM) -> CheckpointRules:
    """DeepSeek V4's checkpoint: release names, FP8 dense weights, hash-routing tables."""
    return CheckpointRules(
        model_name="DeepSeek V4",
        canonical_name=canonical_name,
        skip_reason=_skip_reason,
        names_hint="names after mapping to the release naming",
        dense=_dense,
        scale_suffixes=_scale_suffixes,
        tied=("head.weight", "embed.weight") if model.config.tie_word_embeddings else None,
        # The hash layers' token -> experts tables are integer buffers, not parameters.
        extra_tensors={
            f"layers.{i}.ffn.gate.tid2eid": layer.ffn.gate.load_tid2eid
            for i, layer in enumerate(model.decoder_layers)
            if layer.ffn.is_hash
        },
    )


def load_weights(
    model: DeepseekV4ForCausalLM,
    source: WeightSource | Mapping[str, torch.Tensor],
    opts: LoadOptions = DEFAULT_LOAD_OPTIONS,
) -> LoadReport:
    """Fill ``model`` from ``source`` (a :class:`WeightSource` or a name -> tensor mapping);
    returns what is resident against the checkpoint bytes of this rank's share.

    Expert-parallel (MegaMoE) layers also get their MegaMoE weights from
    ``opts.mega_weight_builder`` (default: DeepGEMM's layout when DeepGEMM is usable)."""
    return load_checkpoint(model, as_weight_source(source), checkpoint_rules(model), opts)


def load_deepseek_v4(
    model_dir: str | os.PathLike[str],
    spec: LayerBuildSpec = DEFAULT_BUILD_SPEC,
    opts: LoadOptions = DEFAULT_LOAD_OPTIONS,
) -> DeepseekV4ForCausalLM:
    """config.json + safetensors in ``model_dir`` -> a ready model (this rank's shard)."""
    model = DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_json_file(model_dir), spec)
    return load_model_dir(model, model_dir, checkpoint_rules(model), opts)
