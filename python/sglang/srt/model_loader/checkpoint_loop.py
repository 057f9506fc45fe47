"""The one checkpoint loop every model's loader runs, and the hooks through which a model says
what differs.

The loop walks the model, not the checkpoint: every parameter is looked up under its own name
(after the model's ``canonical_name`` mapped the checkpoint's spelling) and handed to the
``weight_loader`` its layer attached, which knows the sharding (column- or row-parallel slice,
replicated copy, per-head slice). Then each ``FusedMoE`` reads its routed experts (this rank's part)
under its module path. Missing tensors fail before anything is copied; tensors nothing asked for
fail (or warn) at the end. A checkpoint tensor that is no parameter (DeepSeek V4's hash-routing
tables) is a buffer with a ``weight_loader`` of its own, loaded the same way. Adding a model means
writing its :class:`CheckpointRules`.
"""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import torch
from tqdm.auto import tqdm

from sglang.srt.layers.moe.expert_plan import Conversion, resolve_runner
from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.layers.quantization.block_fp8 import BlockFp8Weight
from sglang.srt.mem_cache.memory_models.weight_bytes import BytesRatio, WeightBytes, human_bytes
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex, ReadBytes, WeightLoadError
from sglang.srt.model_loader.expert_loading import (
    ExpertShard,
    LayerExpertsLoad,
    ScaleSuffixes,
    expert_checkpoint_format,
    load_layer_experts,
)
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.model_loader.mega_moe_prep import (
    default_mega_weight_builder,
    loader_device_facts,
    log_mega_weights_built,
)
from sglang.srt.model_loader.resident_weights import (
    dtype_format,
    layer_of,
    log_resident_weights,
    resident_weight_bytes,
    weight_group,
)
from sglang.srt.model_loader.weight_source import SafetensorsWeightSource, WeightSource
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)


class LoadableModel(Protocol):
    """What the loop reads of a model besides its modules: the model dtype (the resident
    experts' plan) and its device."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...


ModelT = TypeVar("ModelT", bound=torch.nn.Module)

_LAYER_ID = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class CheckpointRules:
    """What one model declares about its checkpoint; built from its config, since some rules read
    it (the layer count, tied embeddings)."""

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


def checkpoint_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers the checkpoint fills: those whose layer attached a ``weight_loader``."""
    return {n: b for n, b in model.named_buffers() if hasattr(b, "weight_loader")}


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


@dataclass(frozen=True)
class LoadReport:
    """What a load left resident on this rank, what the checkpoint holds of this rank's share
    (both by layer, group and format), and their ratio per layer and for the whole model."""

    resident: WeightBytes
    checkpoint: WeightBytes
    ratios: list[BytesRatio]


def plan_expert_layers(
    index: CheckpointIndex,
    experts: list[tuple[str, int, FusedMoE]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Plan every MoE layer from its checkpoint format (the stored dtype, nothing read) before
    any tensor is copied, so a flag combination that cannot run is refused at once, by name."""
    needs_deep_gemm = any(
        layer.uses_mega_weights or resolve_runner(layer.config.runner, device.type) == "deep_gemm"
        for _, _, layer in experts
    )
    facts = loader_device_facts(device, needs_deep_gemm=needs_deep_gemm)
    for prefix, _, layer in experts:
        fmt = expert_checkpoint_format(index, prefix, ExpertShard.of(layer))
        layer.plan_experts(fmt, dtype, facts)


def _checkpoint_share(
    name: str, read: ReadBytes, kept: float
) -> list[tuple[int | None, str, str, int]]:
    """A parameter's checkpoint bytes times the fraction of them this rank keeps; an FP8 weight
    and its scale count as one ``fp8`` entry."""
    fp8 = torch.float8_e4m3fn in read.by_dtype
    parts = {"fp8": read.total} if fp8 else {dtype_format(d): n for d, n in read.by_dtype.items()}
    return [(layer_of(name), weight_group(name), f, int(n * kept)) for f, n in parts.items()]


def _log_expert_plans(model_name: str, loads: list[LayerExpertsLoad]) -> None:
    by_plan: dict[str, int] = {}
    for load in loads:
        text = load.plan.describe()
        by_plan[text] = by_plan.get(text, 0) + 1
    for text, count in by_plan.items():
        logger.info(f"{model_name} routed experts ({count} MoE layers): {text}")
    unbuilt = [x for x in loads if x.plan.mega_reason is not None and not x.mega_weights]
    if unbuilt:
        plan = unbuilt[0].plan
        logger.warning(
            f"MegaMoE weights are not built ({plan.checkpoint.value} experts): "
            f"{plan.mega_reason}; {len(unbuilt)} MoE layers use the normal path"
        )
    dequantised = [x for x in loads if x.plan.conversion is Conversion.DEQUANTISE]
    if dequantised:
        logger.info(
            f"{model_name}: --dtype float32 (the exactness check): MXFP4 experts of "
            f"{len(dequantised)} MoE layers dequantised to fp32 at load, "
            f"{human_bytes(sum(x.checkpoint_bytes for x in dequantised))} as stored"
        )
    stats = [x.conversion for x in loads if x.conversion is not None]
    if stats:
        total = stats[0]
        for part in stats[1:]:
            total = total + part
        kernel = {x.plan.mega_kernel or x.plan.runner for x in loads if x.conversion is not None}
        exact = (
            "every block exact"
            if not total.inexact_blocks
            else f"{total.inexact_blocks} inexact (rounded, largest error "
            f"{total.max_error_to_amax:.2e} of the block's largest magnitude)"
        )
        logger.info(
            f"{model_name}: MXFP4 experts of {len(stats)} MoE layers converted to FP8 128x128 "
            f"blocks at load for {', '.join(sorted(kernel))}: "
            f"{human_bytes(total.fp8_bytes)} resident against "
            f"{human_bytes(total.mxfp4_bytes)} as MXFP4 "
            f"(+{human_bytes(total.fp8_bytes - total.mxfp4_bytes)}, "
            f"{total.fp8_bytes / max(total.mxfp4_bytes, 1):.2f}x); {total.blocks} blocks, {exact}"
        )


def load_checkpoint(
    model: torch.nn.Module, source: WeightSource, rules: CheckpointRules, opts: LoadOptions
) -> LoadReport:
    """Fill ``model`` (this rank's shard) from ``source`` as ``rules`` say; log and return what
    is resident against the checkpoint bytes of this rank's share."""
    facts = cast(LoadableModel, model)
    index = _build_index(source, rules)
    if rules.tied is not None:
        index.tie(*rules.tied)
    params = dict(model.named_parameters())
    buffers = checkpoint_buffers(model)
    index.require([*params, *buffers], rules.names_hint)
    experts = expert_layers(model)
    plan_expert_layers(index, experts, facts.dtype, facts.device)
    layout_builder = None
    if opts.mega_weight_builder is None and any(
        layer.expert_plan is not None and layer.expert_plan.is_mega for _, _, layer in experts
    ):
        layout_builder = default_mega_weight_builder(facts.device)
    share: list[tuple[int | None, str, str, int]] = []
    loads: list[LayerExpertsLoad] = []
    # tqdm's default lock is a multiprocessing RLock: a named semaphore in /dev/shm that outlives
    # a process ended before its exit handlers run (a rank killed with its process group, a test
    # rank leaving through os._exit). One thread draws this bar: a thread lock does.
    tqdm.set_lock(threading.RLock())
    with tqdm(
        total=len(params) + len(buffers) + len(experts),
        desc=f"Loading {rules.model_name} weights",
        disable=not opts.progress,
        unit="tensor",
    ) as bar:
        for name, param in params.items():
            with index.counting() as read:
                full = rules.dense(index, name)
            index.load_param(name, param, full)
            # This rank's fraction of the tensor (its FP8 scale is cut the same way).
            whole = full.weight if isinstance(full, BlockFp8Weight) else full
            share += _checkpoint_share(name, read, param.numel() / max(whole.numel(), 1))
            bar.update()
        for name, buffer in buffers.items():
            with index.naming(name), index.counting() as read:
                buffer.weight_loader(buffer, index.get(name))  # type: ignore[attr-defined]
            share += _checkpoint_share(name, read, 1.0)
            bar.update()
        for prefix, layer_id, layer in experts:
            result = load_layer_experts(
                index,
                layer,
                prefix,
                layer_id=layer_id,
                scale_suffixes=rules.scale_suffixes,
                dtype=facts.dtype,
                mega_weight_builder=opts.mega_weight_builder,
                mega_layout_builder=layout_builder,
            )
            loads.append(result)
            share.append(
                (layer_id, "routed_experts", result.plan.checkpoint.value, result.checkpoint_bytes)
            )
            bar.update()
    index.check_all_used(strict=opts.strict, logger=logger)
    log_mega_weights_built(rules.model_name, sum(x.mega_weights for x in loads), len(experts))
    _log_expert_plans(rules.model_name, loads)
    checkpoint = WeightBytes.of(share)
    resident = resident_weight_bytes(model)
    ratios = log_resident_weights(rules.model_name, resident, checkpoint)
    return LoadReport(resident, checkpoint, ratios)


def load_model_dir(
    model: ModelT, model_dir: str | os.PathLike[str], rules: CheckpointRules, opts: LoadOptions
) -> ModelT:
    """``model`` (this rank's empty shard) filled from the safetensors in ``model_dir``, in eval
    mode."""
    with SafetensorsWeightSource(model_dir) as source:
        load_checkpoint(model, source, rules, opts)
    return model.eval()
