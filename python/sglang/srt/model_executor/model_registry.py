"""Architectures this engine serves: config.json ``architectures`` / ``model_type`` -> loader.

A loader builds this rank's shard of the model from a checkpoint directory, as the
:class:`LayerBuildSpec` says, and reads the checkpoint as the :class:`LoadOptions` say. Every model
served
here exposes the same batch API: ``new_request_cache()`` and
``forward(input_ids [T], positions [T], batch)`` -> fp32 logits ``[T, V]``, with ``batch`` made by
``make_batch(seq_lens, caches)``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions


@dataclass(frozen=True)
class ModelEntry:
    architecture: str
    model_types: tuple[str, ...]
    load: Callable[[str, LayerBuildSpec, LoadOptions], Any]
    make_batch: Callable[[Sequence[int], Sequence[Any]], Any]
    # DP attention: the model gathers its tokens around the MoE (layers/dp_attention's dp_gather
    # and dp_scatter), shards attention over the attention-TP group and has forward_idle().
    supports_dp_attention: bool = False


def dp_attention_unsupported_reason(entry: ModelEntry) -> str | None:
    """None when ``entry`` can serve with --enable-dp-attention; otherwise why not."""
    if entry.supports_dp_attention:
        return None
    return (
        f"{entry.architecture} does not gather its tokens around the MoE yet (the engine side "
        "of DP attention is ready: scheduling, plans, process groups); serve it with "
        "--tp-size alone"
    )


# Loaders and batch classes are imported on first use: importing this registry stays cheap.


def _load_deepseek_v4(path: str, spec: LayerBuildSpec, opts: LoadOptions) -> Any:
    from sglang.srt.model_loader.deepseek_v4_loader import load_deepseek_v4

    return load_deepseek_v4(path, spec, opts)


def _deepseek_v4_batch(seq_lens: Sequence[int], caches: Sequence[Any]) -> Any:
    from sglang.srt.models.deepseek_v4 import DeepseekV4Batch

    return DeepseekV4Batch(list(seq_lens), list(caches))


def _load_kimi_k3(path: str, spec: LayerBuildSpec, opts: LoadOptions) -> Any:
    from sglang.srt.model_loader.kimi_k3_loader import load_kimi_k3

    return load_kimi_k3(path, spec, opts)


def _kimi_k3_batch(seq_lens: Sequence[int], caches: Sequence[Any]) -> Any:
    from sglang.srt.models.kimi_k3 import KimiK3Batch

    return KimiK3Batch(list(seq_lens), list(caches))


MODELS: tuple[ModelEntry, ...] = (
    ModelEntry(
        "DeepseekV4ForCausalLM",
        ("deepseek_v4",),
        _load_deepseek_v4,
        _deepseek_v4_batch,
        supports_dp_attention=True,
    ),
    ModelEntry(
        "KimiK3ForCausalLM",
        ("kimi_k3", "kimi_linear"),
        _load_kimi_k3,
        _kimi_k3_batch,
        supports_dp_attention=True,
    ),
)


class UnsupportedModelError(ValueError):
    pass


def read_model_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    return config


def find_model(config: dict[str, Any]) -> ModelEntry:
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    for entry in MODELS:
        if entry.architecture in archs or model_type in entry.model_types:
            return entry
    supported = ", ".join(f"{e.architecture} ({'/'.join(e.model_types)})" for e in MODELS)
    raise UnsupportedModelError(
        f"unsupported model: architectures={archs}, model_type={model_type!r}; this engine "
        f"serves {supported}"
    )
