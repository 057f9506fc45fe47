"""Load a Kimi K3 model from a directory (config.json + safetensors) or from named tensors.

Every parameter is looked up by its model name after mapping the checkpoint's spelling (see
``kimi_k3_names``); each parameter's ``weight_loader`` checks the full shape and keeps this rank's
shard (TP: heads / intermediate rows; fp32 KDA tensors stay fp32). Routed experts:
- per-expert ``experts.E.w1|w2|w3`` in bf16, MXFP4 (``weight_packed`` two E2M1 values a byte +
  ``weight_scale`` one UE8M0 byte per 32, dequantised to the model dtype), or FP8 with 128x128
  block scales (``weight_scale_inv``), or transformers' stacked ``gate_up_proj`` / ``down_proj``;
- only this rank's part is read and cut *as stored* (TP: a slice of the intermediate dim; MegaMoE:
  whole experts), so MXFP4 is dequantised for that part alone, then stacked as ``w13 = [w1; w3]``
  and handed to ``FusedMoE.load_local_weights``;
- MegaMoE (expert-parallel layers): this rank's stacked checkpoint experts also go to
  ``mega_weight_builder`` (default: DeepGEMM's layout, when DeepGEMM is usable; see
  ``mega_moe_prep``) and the result is set as the layer's MegaMoE weights.
A missing, mis-shaped, wrongly typed or (with ``strict``) unexpected tensor raises
:class:`WeightLoadError` naming it. Vision tensors, and layers past ``num_hidden_layers`` (MTP),
are skipped with one log line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from tqdm.auto import tqdm

from sglang.srt.layers.moe.expert_weights import WeightFormat
from sglang.srt.layers.moe.layer import A2ABackend
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex as _Index
from sglang.srt.model_loader.checkpoint_index import WeightLoadError
from sglang.srt.model_loader.expert_loading import FP8_DTYPES, load_layer_experts
from sglang.srt.model_loader.kimi_k3_names import canonical_name, layer_of
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
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_config import KimiK3Config
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)


def _build_index(source: WeightSource, num_layers: int) -> _Index:
    def in_model(name: str) -> str | None:
        canon = canonical_name(name)
        layer = None if canon is None else layer_of(canon)
        return None if layer is not None and layer >= num_layers else canon

    index, skipped = _Index.build(source, in_model)
    # The two reasons to skip, told apart for the log: no text-model name, or a layer past ours.
    skipped_vision = sum(canonical_name(name) is None for name in skipped)
    skipped_layers = len(skipped) - skipped_vision
    if skipped_vision:
        logger.info(f"skipping {skipped_vision} vision tower / projector tensors: text-only model")
    if skipped_layers:
        logger.info(
            f"skipping {skipped_layers} tensors of layers >= num_hidden_layers={num_layers} (e.g. MTP)"
        )
    return index


def _dense(index: _Index, canon: str) -> torch.Tensor:
    tensor = index.get(canon)
    if not tensor.dtype.is_floating_point or tensor.dtype in FP8_DTYPES:
        raise WeightLoadError(
            f"tensor {index.ckpt_name(canon)!r} is {tensor.dtype}: only the routed experts may be quantised"
        )
    return tensor


def _scale_suffixes(fmt: WeightFormat) -> tuple[str, ...]:
    # compressed-tensors names MXFP4 scales ``weight_scale``; FP8 block scales come either way.
    if fmt is WeightFormat.MXFP4:
        return (".weight_scale",)
    return (".weight_scale_inv", ".weight_scale")


def load_weights(
    model: KimiK3ForCausalLM,
    source: WeightSource | Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    progress: bool = True,
    mega_weight_builder: MegaWeightBuilder | None = None,
) -> None:
    """Fill ``model`` from ``source`` (a :class:`WeightSource` or a name -> tensor mapping)."""
    c = model.config
    index = _build_index(as_weight_source(source), c.num_hidden_layers)
    if c.tie_word_embeddings:
        index.tie("lm_head.weight", "model.embed_tokens.weight")
    params = dict(model.named_parameters())
    index.require(
        params,
        "model names; the checkpoint may spell them language_model.model.layers.N..., with "
        "block_sparse_moe for mlp",
    )
    # (layer id, its routed experts) for the MoE layers; the dense layers have none.
    moe_layers = [
        (i, layer.mlp.experts)
        for i, layer in enumerate(model.decoder_layers)
        if isinstance(layer.mlp, KimiK3MoE)
    ]
    mega_weight_builder = resolve_mega_weight_builder(
        mega_weight_builder, model.device, (experts for _, experts in moe_layers)
    )
    built = 0
    with tqdm(
        total=len(params) + len(moe_layers),
        desc="Loading Kimi K3 weights",
        disable=not progress,
        unit="tensor",
    ) as bar:
        for name, param in params.items():
            index.load_param(name, param, _dense(index, name))
            bar.update()
        for i, experts in moe_layers:
            built += load_layer_experts(
                index,
                experts,
                f"model.layers.{i}.mlp.experts",
                layer_id=i,
                scale_suffixes=_scale_suffixes,
                dtype=model.dtype,
                mega_weight_builder=mega_weight_builder,
            )
            bar.update()
    index.check_all_used(strict=strict, logger=logger)
    log_mega_weights_built("Kimi K3", built, len(moe_layers))


def load_kimi_k3(
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
) -> KimiK3ForCausalLM:
    """config.json + safetensors in ``model_dir`` -> a ready model (this rank's shard)."""
    config = KimiK3Config.from_json_file(model_dir)
    model = KimiK3ForCausalLM(
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
