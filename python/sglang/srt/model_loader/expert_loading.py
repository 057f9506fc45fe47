"""Reading one MoE layer's routed experts from a checkpoint and handing them to its ``FusedMoE``.

Checkpoints store experts either per expert (``{prefix}.E.w1|w3|w2.weight``, gate / up / down,
in bf16, FP8 with 128x128 block scales, or MXFP4: two E2M1 values a byte plus one UE8M0 scale
per 32) or stacked the way transformers keeps them in memory (``gate_up_proj [E, 2I, H]`` with
the gate rows first, ``down_proj [E, H, I]``, unquantised). The models differ only in how a
weight's scale is named, which the caller passes in. :func:`load_layer_experts` is the whole
per-layer step a loader runs: read this rank's part, hand it to the ``FusedMoE``, and (expert
parallel) build its MegaMoE weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang.srt.layers.moe.expert_weights import (
    FP8_BLOCK,
    WeightFormat,
    expert_weights_from_checkpoint,
    stack_expert_tensors,
)
from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.layers.quantization.mxfp4 import MXFP4_DTYPES, MXFP4_GROUP
from sglang.srt.model_loader.checkpoint_experts import CheckpointExperts
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex, WeightLoadError
from sglang.srt.model_loader.mega_moe_prep import MegaWeightBuilder, attach_mega_weights

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


def expert_format(w: torch.Tensor) -> WeightFormat:
    if w.dtype in MXFP4_DTYPES:
        return WeightFormat.MXFP4
    if w.dtype in FP8_DTYPES:
        return WeightFormat.FP8
    return WeightFormat.BF16


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


def load_experts(
    experts: FusedMoE, layer_id: int, ckpt: CheckpointExperts, dtype: torch.dtype
) -> None:
    """Hand ``ckpt`` (this rank's part, from :func:`read_experts` with ``ExpertShard.of(experts)``)
    to the layer's ``FusedMoE``; MXFP4 is dequantised here, for this part only."""
    try:
        experts.load_local_weights(
            expert_weights_from_checkpoint(
                ckpt.fmt, ckpt.w13, ckpt.w2, ckpt.w13_scale, ckpt.w2_scale, dtype=dtype
            )
        )
    except (ValueError, TypeError) as exc:
        raise WeightLoadError(
            f"layer {layer_id} routed experts ({ckpt.fmt.value}): {exc}"
        ) from None


def load_layer_experts(
    index: CheckpointIndex,
    experts: FusedMoE,
    prefix: str,
    *,
    layer_id: int,
    scale_suffixes: ScaleSuffixes,
    dtype: torch.dtype,
    mega_weight_builder: MegaWeightBuilder | None,
) -> bool:
    """Load one layer's routed experts under ``prefix`` (this rank's part) into ``experts``; True
    when its MegaMoE weights were also set (see :func:`attach_mega_weights`).

    The expert count and sizes come from ``experts.config``: the layer already holds what the
    checkpoint must match, so every model reads its experts the same way."""
    c = experts.config
    ckpt = read_experts(
        index,
        prefix,
        layer_id=layer_id,
        num_experts=c.num_experts,
        hidden=c.hidden_size,
        inter=c.intermediate_size,
        scale_suffixes=scale_suffixes,
        shard=ExpertShard.of(experts),
    )
    load_experts(experts, layer_id, ckpt, dtype)
    return attach_mega_weights(experts, layer_id, ckpt, mega_weight_builder)
