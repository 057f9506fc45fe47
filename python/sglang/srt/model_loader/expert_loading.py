"""Reading one MoE layer's routed experts from a checkpoint and handing them to its ``FusedMoE``.

Checkpoints store experts either per expert (``{prefix}.E.w1|w3|w2.weight``, gate / up / down,
in bf16, FP8 with 128x128 block scales, or MXFP4: two E2M1 values a byte plus one UE8M0 scale
per 32) or stacked the way transformers keeps them in memory (``gate_up_proj [E, 2I, H]`` with
the gate rows first, ``down_proj [E, H, I]``, unquantised). The models differ only in how a
weight's scale is named, which the caller passes in.
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
from sglang.srt.layers.quantization.mxfp4 import MXFP4_GROUP
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex, WeightLoadError

_FP4_DTYPES = (torch.uint8, torch.int8)
FP8_DTYPES = (torch.float8_e4m3fn,)

# The suffixes, in order of preference, that may replace ``.weight`` to name a weight's scale.
ScaleSuffixes = Callable[[WeightFormat], tuple[str, ...]]


@dataclass(frozen=True)
class CheckpointExperts:
    """One layer's experts as stored, stacked: ``w13 = [w1; w3]`` on rows, and their scales."""

    fmt: WeightFormat
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None


def expert_format(w: torch.Tensor) -> WeightFormat:
    if w.dtype in _FP4_DTYPES:
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
        f"{fmt.value} expert tensor {index.ckpt_name(weight_name)!r} has no scale ({' or '.join(base + s for s in suffixes)})"
    )


def read_experts(
    index: CheckpointIndex,
    prefix: str,
    *,
    layer_id: int,
    num_experts: int,
    hidden: int,
    inter: int,
    scale_suffixes: ScaleSuffixes,
) -> CheckpointExperts:
    """The experts under ``prefix``, each tensor shape-checked by name."""
    fused = f"{prefix}.gate_up_proj"
    if index.has(fused):
        w13, w2 = index.get(fused), index.get(f"{prefix}.down_proj")
        if expert_format(w13) is not WeightFormat.BF16:
            raise WeightLoadError(
                f"stacked expert tensors {index.ckpt_name(fused)!r} are only supported unquantised"
            )
        return CheckpointExperts(WeightFormat.BF16, w13, w2)
    per: dict[str, list[torch.Tensor]] = {"w1": [], "w3": [], "w2": []}
    scales: dict[str, list[torch.Tensor]] = {"w1": [], "w3": [], "w2": []}
    fmt: WeightFormat | None = None
    for e in range(num_experts):
        for w in ("w1", "w3", "w2"):
            name = f"{prefix}.{e}.{w}.weight"
            t = index.get(name)
            this = expert_format(t)
            if fmt is None:
                fmt = this
                if fmt is WeightFormat.FP8 and inter % FP8_BLOCK[0]:
                    # gate and up are stacked on rows, so their 128-row scale blocks must not straddle
                    raise WeightLoadError(
                        f"layer {layer_id}: FP8 experts need moe_intermediate_size "
                        f"({inter}) divisible by {FP8_BLOCK[0]}"
                    )
            if this is not fmt:
                raise WeightLoadError(
                    f"tensor {index.ckpt_name(name)!r} is {t.dtype}; the layer's experts are {fmt.value}"
                )
            # Two FP4 values a byte: the packed K dim is halved.
            pack = 2 if fmt is WeightFormat.MXFP4 else 1
            rows, cols = (hidden, inter) if w == "w2" else (inter, hidden)
            if tuple(t.shape) != (rows, cols // pack):
                raise WeightLoadError(
                    f"tensor {index.ckpt_name(name)!r}: expected shape {(rows, cols // pack)}, got {tuple(t.shape)}"
                )
            per[w].append(t)
            if fmt is not WeightFormat.BF16:
                s = _expert_scale(index, name, fmt, scale_suffixes(fmt))
                if fmt is WeightFormat.MXFP4 and tuple(s.shape) != (rows, cols // MXFP4_GROUP):
                    raise WeightLoadError(
                        f"scale of {index.ckpt_name(name)!r}: expected shape {(rows, cols // MXFP4_GROUP)}, "
                        f"got {tuple(s.shape)}"
                    )
                scales[w].append(s)
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
    """Hand ``ckpt`` to the layer's ``FusedMoE``, which keeps this rank's part."""
    try:
        experts.load_weights(
            expert_weights_from_checkpoint(
                ckpt.fmt, ckpt.w13, ckpt.w2, ckpt.w13_scale, ckpt.w2_scale, dtype=dtype
            )
        )
    except (ValueError, TypeError) as exc:
        raise WeightLoadError(
            f"layer {layer_id} routed experts ({ckpt.fmt.value}): {exc}"
        ) from None
