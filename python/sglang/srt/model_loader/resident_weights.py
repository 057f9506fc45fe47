"""What a rank's model keeps resident, by layer, weight group and format, and how it compares with
the checkpoint bytes of this rank's share.

:func:`resident_weight_bytes` walks the parameters and buffers of every module and the routed
experts of every ``FusedMoE`` (plain tensors, not parameters), counting each storage once (tied
embeddings, a MegaMoE layout shared with the runner). FP8 tensors and the fp32 scales beside them
in one module count as ``fp8``. The checkpoint side is recorded by the loading loop
(``checkpoint_loop.load_checkpoint``) as it reads: each parameter's tensors times the fraction of
them this rank keeps, and the routed experts as cut for this rank.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.mem_cache.memory_models.weight_bytes import (
    BytesRatio,
    WeightBytes,
    human_bytes,
    resident_vs_checkpoint,
)
from sglang.srt.model_loader.name_rules import first_match, name_rules
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# (pattern on the dotted name, group), first match wins; both models' spellings.
_GROUP_RULES = name_rules(
    (r"(^|\.)shared_experts(\.|$)", "shared_experts"),
    (r"(^|\.)experts(\.|$)", "routed_experts"),
    (r"(^|\.)(attn|self_attn)(\.|$)", "attention"),
    (r"(^|\.)(embed|embed_tokens|head|lm_head)(\.|$)", "embeddings_head"),
)
_FORMAT_OF_DTYPE = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e8m0fnu: "ue8m0",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int32: "int32",
    torch.int64: "int64",
}


def layer_of(name: str) -> int | None:
    """The decoder layer a dotted name sits in (None: a model-level tensor)."""
    m = _LAYER.search(name)
    return None if m is None else int(m.group(1))


def weight_group(name: str) -> str:
    """The group of a parameter, buffer or module path (module docstring of ``weight_bytes``)."""
    return first_match(name, _GROUP_RULES, "other")


def dtype_format(dtype: torch.dtype) -> str:
    return _FORMAT_OF_DTYPE.get(dtype, str(dtype).removeprefix("torch."))


def expert_format(weights: ExpertWeights) -> str:
    """``mxfp4``, ``fp8``, ``bf16`` ... with `` mega`` for DeepGEMM's MegaMoE layout."""
    fmt = weights.fmt.value if weights.is_mxfp4 or weights.is_fp8 else None
    label = fmt or dtype_format(weights.w13.dtype)
    return label + (" mega" if weights.is_mega else "")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _tensors_in(value: object) -> list[torch.Tensor]:
    """The tensors in a (nested) tuple, e.g. MegaMoE weights; nothing for a placeholder."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def resident_weight_bytes(model: nn.Module) -> WeightBytes:
    """Every resident weight of ``model`` by (layer, group, format), each storage once."""
    seen: set[tuple[str, int]] = set()
    items: list[tuple[int | None, str, str, int]] = []

    def count(name: str, tensors: list[torch.Tensor], fmt: str | None = None) -> None:
        for t in tensors:
            key = _storage_key(t)
            if t.numel() == 0 or key in seen:
                continue
            seen.add(key)
            label = fmt or dtype_format(t.dtype)
            items.append((layer_of(name), weight_group(name), label, _storage_bytes(t)))

    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        own = [
            (prefix + n, t)
            for n, t in [
                *module.named_parameters(recurse=False),
                *module.named_buffers(recurse=False),
            ]
            if t is not None
        ]
        # FP8 weights' fp32 block scales count as FP8: one format per quantised weight
        fp8_module = any(t.dtype == torch.float8_e4m3fn for _, t in own)
        for name, t in own:
            scale = fp8_module and "scale" in name.rsplit(".", 1)[-1]
            count(name, [t], "fp8" if scale else None)
        if isinstance(module, FusedMoE):
            experts = prefix + "experts"
            if module.weights is not None:
                count(experts, list(module.weights.tensors()), expert_format(module.weights))
            beside = _tensors_in(module.mega_weights_beside)
            if beside:
                count(experts, beside, "mega beside")
    return WeightBytes.of(items)


def log_resident_weights(
    model_name: str, resident: WeightBytes, checkpoint: WeightBytes | None
) -> list[BytesRatio]:
    """The startup lines: resident bytes by group and format, and against the checkpoint bytes of
    this rank's share (whole model, and the layer with the highest ratio)."""
    logger.info(f"{model_name} resident weights on this rank: {resident.describe()}")
    if checkpoint is None or not checkpoint.total():
        return []
    rows = resident_vs_checkpoint(resident, checkpoint)
    whole = rows[-1]
    layers = [r for r in rows[:-1] if r.checkpoint]
    worst = max(layers, key=lambda r: r.ratio) if layers else None
    worst_text = f"; highest layer {worst.layer}: {worst.ratio:.3f}x" if worst is not None else ""
    logger.log(
        logging.INFO,
        f"{model_name} resident / checkpoint bytes of this rank's share: "
        f"{human_bytes(whole.resident)} / {human_bytes(whole.checkpoint)} = "
        f"{whole.ratio:.3f}x{worst_text} (checkpoint {checkpoint.describe()})",
    )
    return rows
