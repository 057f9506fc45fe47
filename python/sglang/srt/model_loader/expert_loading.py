"""Reading one MoE layer's routed experts from a checkpoint and handing them to its ``FusedMoE``.

Checkpoints store experts either per expert (``{prefix}.E.w1|w3|w2.weight``, gate / up / down,
in bf16, FP8 with 128x128 block scales, or MXFP4: two E2M1 values a byte plus one UE8M0 scale
per 32) or stacked the way transformers keeps them in memory (``gate_up_proj [E, 2I, H]`` with
the gate rows first, ``down_proj [E, H, I]``, unquantised). The models differ only in how a
weight's scale is named, which the caller passes in. :func:`load_layer_experts` is the whole
per-layer step a loader runs: read this rank's part and keep it as the layer's plan says
(``layers/moe/expert_plan.py``): cast, kept FP8, kept packed MXFP4, dequantised (exactness
check), converted to FP8, or laid out for DeepGEMM's MegaMoE kernel as the only copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang.srt.layers.moe.expert_plan import Conversion, DeviceFacts, ExpertPlan
from sglang.srt.layers.moe.expert_weights import (
    FP8_BLOCK,
    ExpertWeights,
    WeightFormat,
    expert_weights_from_checkpoint,
    mxfp4_experts,
    stack_expert_tensors,
)
from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.layers.moe.mega_moe_weights import MegaMoEWeightError
from sglang.srt.layers.quantization.mxfp4 import MXFP4_DTYPES, MXFP4_GROUP
from sglang.srt.layers.quantization.mxfp4_to_fp8 import ConversionStats, mxfp4_to_fp8_blocks
from sglang.srt.model_loader.checkpoint_experts import CheckpointExperts
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex, WeightLoadError
from sglang.srt.model_loader.mega_moe_prep import (
    MegaWeightBuilder,
    attach_mega_weights,
    default_mega_weight_builder,
    loader_device_facts,
)

FP8_DTYPES = (torch.float8_e4m3fn,)

# The suffixes, in order of preference, that may replace ``.weight`` to name a weight's scale.
ScaleSuffixes = Callable[[WeightFormat], tuple[str, ...]]


@dataclass(frozen=True)
class ExpertShard:
    """What one rank keeps of a layer's experts: which experts, and which intermediate rows of
    each (all of them under expert parallelism, a tensor-parallel slice otherwise)."""

    experts: range
    inter: range
    inter_size: int

    @classmethod
    def of(cls, layer: FusedMoE) -> ExpertShard:
        return cls(layer.local_experts, layer.local_intermediate, layer.config.intermediate_size)

    @property
    def whole_inter(self) -> bool:
        return len(self.inter) == self.inter_size


# Values a stored row holds per column (packed FP4: two a byte) and per scale column; the TP cut
# of ``w2``'s columns must fall on whole scale groups.
_COLS_PER_ELEMENT = {WeightFormat.BF16: 1, WeightFormat.FP8: 1, WeightFormat.MXFP4: 2}
_SCALE_GROUP = {
    WeightFormat.BF16: 1,
    WeightFormat.FP8: FP8_BLOCK[1],
    WeightFormat.MXFP4: MXFP4_GROUP,
}
# Rows a scale row covers (FP8: 128-row blocks; MXFP4: one scale row a weight row).
_SCALE_ROWS = {WeightFormat.BF16: 1, WeightFormat.FP8: FP8_BLOCK[0], WeightFormat.MXFP4: 1}


def _cut(t: torch.Tensor, dim: int, lo: int, hi: int, step: int) -> torch.Tensor:
    # A copy, so the full per-expert tensor is freed once this rank's slice is taken.
    return t.narrow(dim, lo // step, (hi - lo) // step).clone()


def _shard_expert_tensor(
    t: torch.Tensor, w: str, fmt: WeightFormat, shard: ExpertShard, *, is_scale: bool
) -> torch.Tensor:
    """This rank's slice of one expert's ``w1``/``w3`` (rows) or ``w2`` (columns), weight or
    scale, before any dequantisation."""
    if shard.whole_inter:
        return t
    lo, hi = shard.inter.start, shard.inter.stop
    if w == "w2":
        step = _SCALE_GROUP[fmt] if is_scale else _COLS_PER_ELEMENT[fmt]
        return _cut(t, -1, lo, hi, step)
    return _cut(t, 0, lo, hi, _SCALE_ROWS[fmt] if is_scale else 1)


def _check_shardable(fmt: WeightFormat, shard: ExpertShard, layer_id: int) -> None:
    granule = max(_SCALE_GROUP[fmt], _SCALE_ROWS[fmt], _COLS_PER_ELEMENT[fmt])
    if shard.whole_inter or len(shard.inter) % granule == 0:
        return
    raise WeightLoadError(
        f"layer {layer_id}: {fmt.value} experts need this rank's intermediate slice "
        f"({len(shard.inter)} of {shard.inter_size}) divisible by {granule}"
    )


def format_of_dtype(dtype: torch.dtype) -> WeightFormat:
    if dtype in MXFP4_DTYPES:
        return WeightFormat.MXFP4
    if dtype in FP8_DTYPES:
        return WeightFormat.FP8
    return WeightFormat.BF16


def expert_format(w: torch.Tensor) -> WeightFormat:
    return format_of_dtype(w.dtype)


def _expert_scale(
    index: CheckpointIndex, weight_name: str, fmt: WeightFormat, suffixes: tuple[str, ...]
) -> torch.Tensor:
    base = weight_name.removesuffix(".weight")
    for suffix in suffixes:
        if index.has(base + suffix):
            scale = index.get(base + suffix)
            # UE8M0 bytes are kept as such for MXFP4 (its dequant reads them raw)
            return scale if fmt is WeightFormat.MXFP4 else scale.float()
    raise WeightLoadError(
        f"{fmt.value} expert tensor {index.ckpt_name(weight_name)!r} has no scale "
        f"({' or '.join(base + s for s in suffixes)})"
    )


def _stacked_part(index: CheckpointIndex, prefix: str, shard: ExpertShard) -> CheckpointExperts:
    """transformers' unquantised ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, cut."""
    w13, w2 = index.get(f"{prefix}.gate_up_proj"), index.get(f"{prefix}.down_proj")
    if expert_format(w13) is not WeightFormat.BF16:
        raise WeightLoadError(
            f"stacked expert tensors {index.ckpt_name(prefix + '.gate_up_proj')!r} are only "
            "supported unquantised"
        )
    e = slice(shard.experts.start, shard.experts.stop)
    w13, w2 = w13[e], w2[e]
    if not shard.whole_inter:
        lo, hi, inter = shard.inter.start, shard.inter.stop, w13.shape[1] // 2
        w13 = torch.cat([w13[:, lo:hi], w13[:, inter + lo : inter + hi]], dim=1)
        w2 = w2[:, :, lo:hi]
    return CheckpointExperts(WeightFormat.BF16, w13.contiguous(), w2.contiguous())


def read_experts(
    index: CheckpointIndex,
    prefix: str,
    *,
    layer_id: int,
    num_experts: int,
    hidden: int,
    inter: int,
    scale_suffixes: ScaleSuffixes,
    shard: ExpertShard | None = None,
) -> CheckpointExperts:
    """This rank's part (``shard``; default everything) of the experts under ``prefix``, each
    tensor shape-checked by name and cut *as stored*: packed MXFP4 bytes and their scales are
    sliced before anything is dequantised, and only one expert's full tensors are held at a time.

    Experts outside ``shard.experts`` are not read (their rank reads them); they count as used."""
    if shard is None:
        shard = ExpertShard(range(num_experts), range(inter), inter)
    if index.has(f"{prefix}.gate_up_proj"):
        return _stacked_part(index, prefix, shard)
    per: dict[str, list[torch.Tensor]] = {"w1": [], "w3": [], "w2": []}
    scales: dict[str, list[torch.Tensor]] = {"w1": [], "w3": [], "w2": []}
    fmt: WeightFormat | None = None
    # Every scale name any format may use: another rank's experts are skipped unread, so their
    # format is unknown here. The same for every expert and weight, so built once.
    suffixes = {x for f in WeightFormat for x in scale_suffixes(f)}
    for e in range(num_experts):
        if e not in shard.experts:
            for w in ("w1", "w3", "w2"):
                base = f"{prefix}.{e}.{w}"
                index.mark_used(base + ".weight", *(base + x for x in suffixes))
            continue
        for w in ("w1", "w3", "w2"):
            name = f"{prefix}.{e}.{w}.weight"
            t = index.get(name)
            this = expert_format(t)
            if fmt is None:
                fmt = this
                if fmt is WeightFormat.FP8 and inter % FP8_BLOCK[0]:
                    # gate and up are stacked on rows, so their 128-row scale blocks must not
                    # straddle
                    raise WeightLoadError(
                        f"layer {layer_id}: FP8 experts need moe_intermediate_size "
                        f"({inter}) divisible by {FP8_BLOCK[0]}"
                    )
                _check_shardable(fmt, shard, layer_id)
            if this is not fmt:
                raise WeightLoadError(
                    f"tensor {index.ckpt_name(name)!r} is {t.dtype}; the layer's experts are "
                    f"{fmt.value}"
                )
            # Two FP4 values a byte: the packed K dim is halved.
            pack = _COLS_PER_ELEMENT[fmt]
            rows, cols = (hidden, inter) if w == "w2" else (inter, hidden)
            if tuple(t.shape) != (rows, cols // pack):
                raise WeightLoadError(
                    f"tensor {index.ckpt_name(name)!r}: expected shape {(rows, cols // pack)}, got "
                    f"{tuple(t.shape)}"
                )
            per[w].append(_shard_expert_tensor(t, w, fmt, shard, is_scale=False))
            if fmt is not WeightFormat.BF16:
                s = _expert_scale(index, name, fmt, scale_suffixes(fmt))
                if fmt is WeightFormat.MXFP4 and tuple(s.shape) != (rows, cols // MXFP4_GROUP):
                    raise WeightLoadError(
                        f"scale of {index.ckpt_name(name)!r}: expected shape "
                        f"{(rows, cols // MXFP4_GROUP)}, "
                        f"got {tuple(s.shape)}"
                    )
                scales[w].append(_shard_expert_tensor(s, w, fmt, shard, is_scale=True))
    assert fmt is not None
    try:
        w13, w2 = stack_expert_tensors(per["w1"], per["w3"], per["w2"])
        if fmt is WeightFormat.BF16:
            return CheckpointExperts(fmt, w13, w2)
        s13, s2 = stack_expert_tensors(scales["w1"], scales["w3"], scales["w2"])
    except RuntimeError as exc:  # torch.stack / cat on mismatched (scale) shapes
        raise WeightLoadError(f"layer {layer_id} experts have inconsistent shapes: {exc}") from None
    return CheckpointExperts(fmt, w13, w2, s13, s2)


@dataclass(frozen=True)
class LayerExpertsLoad:
    """What loading one layer's experts did: its plan, whether it got MegaMoE weights, the
    MXFP4 -> FP8 conversion's stats (None: no conversion) and the bytes of this rank's share of
    the checkpoint experts."""

    plan: ExpertPlan
    mega_weights: bool
    conversion: ConversionStats | None
    checkpoint_bytes: int


def expert_checkpoint_format(
    index: CheckpointIndex, prefix: str, shard: ExpertShard
) -> WeightFormat:
    """The format of the experts under ``prefix``, from the stored dtype of this rank's first
    expert (nothing is read)."""
    if index.has(f"{prefix}.gate_up_proj"):
        return format_of_dtype(index.dtype_of(f"{prefix}.gate_up_proj"))
    return format_of_dtype(index.dtype_of(f"{prefix}.{shard.experts.start}.w1.weight"))


def resident_experts(
    ckpt: CheckpointExperts,
    plan: ExpertPlan,
    *,
    dtype: torch.dtype,
    device: torch.device,
    build_mega: MegaWeightBuilder | None,
    layer_id: int,
) -> tuple[ExpertWeights, ConversionStats | None]:
    """This rank's checkpoint experts as ``plan`` keeps them on ``device``: cast, kept FP8,
    kept packed MXFP4, dequantised (exactness-check mode) or converted to FP8 (on the device,
    a few experts at a time), and, for a MegaMoE plan, re-laid out by ``build_mega`` as the only
    copy."""
    if ckpt.fmt is WeightFormat.MXFP4 and plan.conversion is not Conversion.DEQUANTISE:
        assert ckpt.w13_scale is not None and ckpt.w2_scale is not None
        weights = mxfp4_experts(ckpt.w13, ckpt.w2, ckpt.w13_scale, ckpt.w2_scale)
    else:
        weights = expert_weights_from_checkpoint(
            ckpt.fmt, ckpt.w13, ckpt.w2, ckpt.w13_scale, ckpt.w2_scale, dtype=dtype
        )
    weights = weights.to(device)
    stats = None
    if plan.conversion is Conversion.MXFP4_TO_FP8:
        assert weights.w13_scale is not None and weights.w2_scale is not None
        q13, s13, st13 = mxfp4_to_fp8_blocks(weights.w13, weights.w13_scale)
        q2, s2, st2 = mxfp4_to_fp8_blocks(weights.w2, weights.w2_scale)
        weights, stats = ExpertWeights(q13, q2, s13, s2), st13 + st2
    if plan.is_mega:
        if build_mega is None:
            raise WeightLoadError(
                f"layer {layer_id}: the plan keeps the MegaMoE layout but no builder is set"
            )
        raw = {
            "w13": weights.w13,
            "w2": weights.w2,
            "w13_scale": weights.w13_scale,
            "w2_scale": weights.w2_scale,
        }
        try:
            weights = ExpertWeights.from_mega(build_mega(layer_id, raw))
        except MegaMoEWeightError as exc:
            raise WeightLoadError(f"layer {layer_id} MegaMoE weights: {exc}") from None
    return weights, stats


def load_layer_experts(
    index: CheckpointIndex,
    experts: FusedMoE,
    prefix: str,
    *,
    layer_id: int,
    scale_suffixes: ScaleSuffixes,
    dtype: torch.dtype,
    mega_weight_builder: MegaWeightBuilder | None,
    mega_layout_builder: MegaWeightBuilder | None = None,
    facts: DeviceFacts | None = None,
) -> LayerExpertsLoad:
    """Load one layer's routed experts under ``prefix`` (this rank's part) into ``experts`` as
    its plan says (planned here from ``facts`` if the loading loop has not planned it).

    ``mega_weight_builder``: the caller's own MegaMoE builder (``LoadOptions``), or None. A layer
    whose plan keeps the MegaMoE layout is built by it, else by ``mega_layout_builder`` (the
    loop's DeepGEMM builder, made here when not given); on a layer whose plan keeps no MegaMoE
    layout, the caller's builder still gets this rank's checkpoint experts and its result is set
    beside (:func:`attach_mega_weights`). The
    expert count and sizes come from ``experts.config``: the layer already holds what the
    checkpoint must match, so every model reads its experts the same way."""
    c = experts.config
    shard = ExpertShard.of(experts)
    plan = experts.expert_plan
    if plan is None:
        if facts is None:
            facts = loader_device_facts(experts.device, needs_deep_gemm=True)
        plan = experts.plan_experts(expert_checkpoint_format(index, prefix, shard), dtype, facts)
    ckpt = read_experts(
        index,
        prefix,
        layer_id=layer_id,
        num_experts=c.num_experts,
        hidden=c.hidden_size,
        inter=c.intermediate_size,
        scale_suffixes=scale_suffixes,
        shard=shard,
    )
    if ckpt.fmt is not plan.checkpoint:
        raise WeightLoadError(
            f"layer {layer_id}: routed experts are {ckpt.fmt.value}, planned for "
            f"{plan.checkpoint.value}"
        )
    build = mega_weight_builder or mega_layout_builder
    if plan.is_mega and build is None:
        build = default_mega_weight_builder(experts.device)
    try:
        weights, stats = resident_experts(
            ckpt, plan, dtype=dtype, device=experts.device, build_mega=build, layer_id=layer_id
        )
        experts.load_local_weights(weights)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, WeightLoadError):
            raise
        raise WeightLoadError(
            f"layer {layer_id} routed experts ({ckpt.fmt.value}): {exc}"
        ) from None
    mega = plan.is_mega
    if not mega:
        mega = attach_mega_weights(experts, layer_id, ckpt, mega_weight_builder)
    return LayerExpertsLoad(plan, mega, stats, ckpt.nbytes)
