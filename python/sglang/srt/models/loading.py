"""Loading any registered model: from a checkpoint directory (its config.json read once, or the
dict the caller already read), or into a built model from named tensors.

The model's registry entry (``models/registry.py``) gives its config class, model class and
checkpoint rules; the one checkpoint loop (``checkpoint_loop.py``) does the rest.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from sglang.srt.layers.build_spec import DEFAULT_BUILD_SPEC, LayerBuildSpec
from sglang.srt.model_loader.checkpoint_loop import LoadReport, load_checkpoint, load_model_dir
from sglang.srt.model_loader.load_options import DEFAULT_LOAD_OPTIONS, LoadOptions
from sglang.srt.model_loader.weight_source import WeightSource, as_weight_source
from sglang.srt.models.config_common import read_config_json
from sglang.srt.models.registry import entry_of, find_model


def load_model(
    model_dir: str | os.PathLike[str],
    spec: LayerBuildSpec = DEFAULT_BUILD_SPEC,
    opts: LoadOptions = DEFAULT_LOAD_OPTIONS,
    *,
    config: Mapping[str, Any] | None = None,
) -> Any:
    """config.json + safetensors in ``model_dir`` -> a ready model (this rank's shard, in eval
    mode). ``config``: the config.json dict when the caller read it already (it is read once)."""
    raw = config if config is not None else read_config_json(model_dir)
    entry = find_model(raw)
    parsed = entry.parse_config(raw)
    model = entry.build(parsed, spec)
    return load_model_dir(model, model_dir, entry.checkpoint_rules(parsed), opts)


def load_weights(
    model: Any,
    source: WeightSource | Mapping[str, torch.Tensor],
    opts: LoadOptions = DEFAULT_LOAD_OPTIONS,
) -> LoadReport:
    """Fill a built ``model`` from ``source`` (a :class:`WeightSource` or a name -> tensor
    mapping) by its registered checkpoint rules; returns what is resident against the checkpoint
    bytes of this rank's share. Expert-parallel (MegaMoE) layers also get their MegaMoE weights
    from ``opts.mega_weight_builder`` (default: DeepGEMM's layout when DeepGEMM is usable)."""
    rules = entry_of(model).checkpoint_rules(model.config)
    return load_checkpoint(model, as_weight_source(source), rules, opts)
