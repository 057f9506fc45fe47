"""The one checkpoint loop every model's loader runs, and the hooks through which a model says
what differs.

The loop walks the model, not the checkpoint: every parameter is looked up under its own name
(after the model's ``canonical_name`` mapped the checkpoint's spelling) and handed to the
``weight_loader`` its layer attached, which knows the sharding (column- or row-parallel slice,
replicated copy, per-head slice). Then each ``FusedMoE`` reads its routed experts (this rank's part)
under its module path. Missing tensors fail before anything is copied; tensors nothing asked for
fail (or warn) at the end. Adding a model means writing its :class:`CheckpointRules`.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from tqdm.auto import tqdm

from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.layers.quantization.block_fp8 import BlockFp8Weight
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex, WeightLoadError
from sglang.srt.model_loader.expert_loading import ScaleSuffixes, load_layer_experts
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.model_loader.mega_moe_prep import (
    log_mega_weights_built,
    resolve_mega_weight_builder,
)
from sglang.srt.model_loader.weight_source import SafetensorsWeightSource, WeightSource
from sglang.srt.models.cached_lm import CachedCausalLM
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

ModelT = TypeVar("ModelT", bound=CachedCausalLM[Any])

_LAYER_ID = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class CheckpointRules:
    """What one model declares about its checkpoint; built per model instance, since some rules
    read its config (the layer count, tied embeddings, which layers hash-route)."""

    # "DeepSeek V4": the progress bar and the log lines name the model.
    model_name: str
    # Checkpoint name -> the model's parameter name; ``None`` skips the tensor.
    canonical_name: Callable[[str], str | None]
    # Why a skipped checkpoint name is skipped, e.g. "MTP tensors (mtp.*): ..."; one log line
    # per distinct reason, with its count.
    skip_reason: Callable[[str], str]
    # How the model's names are spelled, for the missing-tensor error.
    names_hint: str
    # A non-expert tensor as the parameter's loader takes it: a float tensor, a block-FP8 weight
    # with its scale (the layer keeps or dequantises it), or refused.
    dense: Callable[[CheckpointIndex, str], torch.Tensor | BlockFp8Weight]
    # The names an expert weight's scale may have, per stored format.
    scale_suffixes: ScaleSuffixes
    # (LM head, embedding) when the checkpoint stores the table once for both.
    tied: tuple[str, str] | None = None
    # Tensors that are not parameters (DeepSeek V4's hash-routing tables), each with its loader.
    extra_tensors: Mapping[str, Callable[[torch.Tensor], None]] = field(default_factory=dict)


def _build_index(source: WeightSource, rules: CheckpointRules) -> CheckpointIndex:
    index, skipped = CheckpointIndex.build(source, rules.canonical_name)
    for reason, count in Counter(rules.skip_reason(name) for name in skipped).items():
        logger.info(f"skipping {count} {reason}")
    return index


def expert_layers(model: torch.nn.Module) -> list[tuple[str, int, FusedMoE]]:
    """``(module path, layer id, layer)`` of every routed-expert layer, in model order; the path
    is the checkpoint prefix of its experts."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            m = _LAYER_ID.search(name + ".")
            if m is None:
                raise WeightLoadError(f"MoE layer {name!r} is not under a numbered decoder layer")
            found.append((name, int(m.group(1)), module))
    return found


def load_checkpoint(
    model: CachedCausalLM[Any], source: WeightSource, rules: CheckpointRules, opts: LoadOptions
) -> None:
    """Fill ``model`` (this rank's shard) from ``source`` as ``rules`` say."""
    index = _build_index(source, rules)
    if rules.tied is not None:
        index.tie(*rules.tied)
    params = dict(model.named_parameters())
    index.require([*params, *rules.extra_tensors], rules.names_hint)
    experts = expert_layers(model)
    builder = resolve_mega_weight_builder(
        opts.mega_weight_builder, model.device, (layer for _, _, layer in experts)
    )
    built = 0
    with tqdm(
        total=len(params) + len(rules.extra_tensors) + len(experts),
        desc=f"Loading {rules.model_name} weights",
        disable=not opts.progress,
        unit="tensor",
    ) as bar:
        for name, param in params.items():
            index.load_param(name, param, rules.dense(index, name))
            bar.update()
        for name, load in rules.extra_tensors.items():
            with index.naming(name):
                load(index.get(name))
            bar.update()
        for prefix, layer_id, layer in experts:
            built += load_layer_experts(
                index,
                layer,
                prefix,
                layer_id=layer_id,
                scale_suffixes=rules.scale_suffixes,
                dtype=model.dtype,
                mega_weight_builder=builder,
            )
            bar.update()
    index.check_all_used(strict=opts.strict, logger=logger)
    log_mega_weights_built(rules.model_name, built, len(experts))


def load_model_dir(
    model: ModelT, model_dir: str | os.PathLike[str], rules: CheckpointRules, opts: LoadOptions
) -> ModelT:
    """``model`` (this rank's empty shard) filled from the safetensors in ``model_dir``, in eval
    mode."""
    with SafetensorsWeightSource(model_dir) as source:
        load_checkpoint(model, source, rules, opts)
    return model.eval()
