"""The models this engine serves: config.json ``architectures`` / ``model_type`` -> the entry that
says everything the engine needs of a model.

Each model registers one :class:`ModelEntry`, by one :func:`register_model` call at the end of its
model file: its config class (parsed from the config.json dict, which the caller read once), its
model class (built from ``(config, spec)``), its batch class (``make_batch(seq_lens, caches)``),
its checkpoint rules (built from the config: how the checkpoint spells and stores its tensors)
and whether it serves DP attention. What a model can do beyond the batch API (a slot pool, the
static decode, a memory model, an FP8 KV cache) it declares by implementing the Protocols of
``model_executor/model_abilities.py`` (``abilities_of(model)`` lists which).
:func:`find_model` imports every module of ``sglang.srt.models`` once, so a new model needs no
line anywhere else.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.models.cached_lm import RequestBatch
from sglang.srt.models.config_common import JsonModelConfig
from sglang.srt.utils.registry import Registry

if TYPE_CHECKING:
    from sglang.srt.model_loader.checkpoint_loop import CheckpointRules


@dataclass(frozen=True)
class ModelEntry:
    architecture: str  # config.json "architectures" name
    model_types: tuple[str, ...]  # config.json "model_type" values that mean this model
    config_class: type[JsonModelConfig]
    model_class: Callable[[Any, LayerBuildSpec], Any]  # (config, spec) -> this rank's shard
    batch_class: type[RequestBatch[Any]]
    checkpoint_rules: Callable[[Any], CheckpointRules]  # config -> how its checkpoint reads
    # DP attention: the model gathers its tokens around the MoE (layers/dp_attention's dp_gather
    # and dp_scatter), shards attention over the attention-TP group and has forward_idle().
    supports_dp_attention: bool = False

    def parse_config(self, raw: Mapping[str, Any]) -> Any:
        """The model's config from a config.json dict (read once by the caller)."""
        return self.config_class.from_dict(raw)

    def build(self, config: Any, spec: LayerBuildSpec) -> Any:
        """This rank's shard of the model, its weights not loaded."""
        return self.model_class(config, spec)

    def make_batch(self, seq_lens: Sequence[int], caches: Sequence[Any]) -> RequestBatch[Any]:
        return self.batch_class(list(seq_lens), list(caches))


MODELS: Registry[ModelEntry] = Registry("model architecture")


def register_model(entry: ModelEntry) -> ModelEntry:
    """Serve ``entry``'s architecture (one call at the end of its model file)."""
    MODELS.register(entry.architecture)(lambda: entry)
    return entry


class UnsupportedModelError(ValueError):
    pass


_imported = False


def _import_models() -> None:
    """Import every module of ``sglang.srt.models`` once: each model file registers itself."""
    global _imported
    if _imported:
        return
    import sglang.srt.models as package

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    _imported = True


def model_entries() -> list[ModelEntry]:
    """Every registered model, by architecture name."""
    _import_models()
    return [MODELS.create(name) for name in MODELS.names()]


def find_model(config: Mapping[str, Any]) -> ModelEntry:
    """The entry for a config.json dict: by ``architectures``, else by ``model_type``."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    entries = model_entries()
    for entry in entries:
        if entry.architecture in archs or model_type in entry.model_types:
            return entry
    supported = ", ".join(f"{e.architecture} ({'/'.join(e.model_types)})" for e in entries)
    raise UnsupportedModelError(
        f"unsupported model: architectures={archs}, model_type={model_type!r}; this engine "
        f"serves {supported}"
    )


def entry_of(model: object) -> ModelEntry:
    """The entry whose model class built ``model``."""
    for entry in model_entries():
        if type(model) is entry.model_class:
            return entry
    raise UnsupportedModelError(f"{type(model).__name__} is no registered model class")


def dp_attention_unsupported_reason(entry: ModelEntry) -> str | None:
    """None when ``entry`` can serve with --enable-dp-attention; otherwise why not."""
    if entry.supports_dp_attention:
        return None
    return (
        f"{entry.architecture} does not gather its tokens around the MoE yet (the engine side "
        "of DP attention is ready: scheduling, plans, process groups); serve it with "
        "--tp-size alone"
    )
