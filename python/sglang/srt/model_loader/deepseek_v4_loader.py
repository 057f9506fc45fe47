"""Load a DeepSeek V4 model from a directory (config.json + safetensors) or from named tensors.

Every parameter of the model is looked up by its (release) name after mapping the checkpoint's
spelling (see ``deepseek_v4_names``); each parameter's ``weight_loader`` checks the full shape and
keeps this rank's shard. Formats:
- dense weights: bf16/fp32, or FP8 e4m3 with a 128x128 block scale (``.scale``, UE8M0 or fp32;
  also ``weight_scale_inv``), dequantised to the model dtype at load (the CPU/reference path; the
  maths then equals the dequantised checkpoint's);
- routed experts: per-expert ``w1``/``w2``/``w3`` (or transformers' stacked ``gate_up_proj`` /
  ``down_proj``) in bf16, FP8 128x128 (kept FP8 for the expert runners) or MXFP4 (packed bytes +
  UE8M0 scales per 32, dequantised), through ``expert_weights_from_checkpoint``; only this rank's
  part is read and cut as stored, so MXFP4 is dequantised for that part alone;
- MegaMoE (``a2a_backend="megamoe"``): after each layer's experts load, this rank's checkpoint
  experts are re-laid out for DeepGEMM (``mega_moe_prep``) and set as the layer's MegaMoE weights.
A missing, mis-shaped or (with ``strict``) unexpected tensor raises :class:`WeightLoadError` naming
it. ``mtp.*`` tensors are skipped with one log line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from tqdm.auto import tqdm

from sglang.kernels.ops.quant.fp8 import block_dequant_fp8
from sglang.srt.layers.moe.expert_weights import FP8_BLOCK, WeightFormat
from sglang.srt.layers.moe.layer import A2ABackend
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex as _Index
from sglang.srt.model_loader.checkpoint_index import WeightLoadError
from sglang.srt.model_loader.deepseek_v4_names import canonical_name
from sglang.srt.model_loader.expert_loading import FP8_DTYPES, load_layer_experts
from sglang.srt.model_loader.mega_moe_prep import (
    MegaWeightBuilder,
    log_mega_weights_built,
    resolve_mega_weight_builder,
)
from sglang.srt.model_loader.weight_source import (
    SafetensorsWeightSource,
    WeightSource,
    as_weight_source,
)
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)


def _build_index(source: WeightSource) -> _Index:
    index, skipped = _Index.build(source, canonical_name)
    if skipped:
        logger.info(
            f"skipping {len(skipped)} MTP tensors (mtp.*): the multi-token-prediction layer is not loaded"
        )
    return index


def _dense(index: _Index, canon: str) -> torch.Tensor:
    """A dense weight, FP8 block-dequantised to fp32 when it ships FP8."""
    w = index.get(canon)
    if w.dtype in FP8_DTYPES:
        scale_name = (
            canon[: -len(".weight")] + ".scale" if canon.endswith(".weight") else canon + ".scale"
        )
        if not index.has(scale_name):
            raise WeightLoadError(
                f"FP8 tensor {index.ckpt_name(canon)!r} has no block scale {scale_name!r}"
            )
        scale = index.get(scale_name)
        try:
            w = block_dequant_fp8(w, scale.float(), FP8_BLOCK, dtype=torch.float32)
        except ValueError as exc:
            raise WeightLoadError(f"{index.ckpt_name(scale_name)!r}: {exc}") from None
    return w


def _scale_suffixes(fmt: WeightFormat) -> tuple[str, ...]:
    # ``canonical_name`` already maps ``weight_scale_inv`` onto the release's ``.scale``.
    return (".scale",)


def load_weights(
    model: DeepseekV4ForCausalLM,
    source: WeightSource | Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    progress: bool = True,
    mega_weight_builder: MegaWeightBuilder | None = None,
) -> None:
    """Fill ``model`` from ``source`` (a :class:`WeightSource` or a name -> tensor mapping).

    Expert-parallel (MegaMoE) layers also get their MegaMoE weights from ``mega_weight_builder``
    (default: DeepGEMM's layout when DeepGEMM is usable)."""
    index = _build_index(as_weight_source(source))
    if model.config.tie_word_embeddings:
        index.tie("head.weight", "embed.weight")
    params = dict(model.named_parameters())
    hash_tables = {
        f"layers.{i}.ffn.gate.tid2eid": layer.ffn.gate
        for i, layer in enumerate(model.decoder_layers)
        if layer.ffn.is_hash
    }
    index.require(list(params) + list(hash_tables), "names after mapping to the release naming")
    steps = len(params) + len(hash_tables) + len(model.layers)
    experts = [layer.ffn.experts for layer in model.decoder_layers]
    mega_weight_builder = resolve_mega_weight_builder(mega_weight_builder, model.device, experts)
    built = 0
    with tqdm(
        total=steps, desc="Loading DeepSeek V4 weights", disable=not progress, unit="tensor"
    ) as bar:
        for name, param in params.items():
            index.load_param(name, param, _dense(index, name))
            bar.update()
        for name, gate in hash_tables.items():
            with index.naming(name):
                gate.load_tid2eid(index.get(name))
            bar.update()
        for i, layer_experts in enumerate(experts):
            built += load_layer_experts(
                index,
                layer_experts,
                f"layers.{i}.ffn.experts",
                layer_id=i,
                scale_suffixes=_scale_suffixes,
                dtype=model.dtype,
                mega_weight_builder=mega_weight_builder,
            )
            bar.update()
    index.check_all_used(strict=strict, logger=logger)
    log_mega_weights_built("DeepSeek V4", built, len(model.layers))


def load_deepseek_v4(
    model_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    moe_runner: str = "auto",
    a2a_backend: A2ABackend = "none",
    strict: bool = True,
    progress: bool = True,
    mega_weight_builder: MegaWeightBuilder | None = None,
) -> DeepseekV4ForCausalLM:
    """config.json + safetensors in ``model_dir`` -> a ready model (this rank's shard)."""
    config = DeepseekV4ModelConfig.from_json_file(model_dir)
    model = DeepseekV4ForCausalLM(
        config,
        dtype=dtype,
        device=device,
        tp_rank=tp_rank,
        tp_size=tp_size,
        moe_runner=moe_runner,
        a2a_backend=a2a_backend,
    )
    with SafetensorsWeightSource(model_dir) as source:
        load_weights(
            model, source, strict=strict, progress=progress, mega_weight_builder=mega_weight_builder
        )
    return model.eval()
