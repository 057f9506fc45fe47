"""How the loader gives expert-parallel ``FusedMoE`` layers their MegaMoE weights, and the
device facts its expert plans are made from.

With ``--moe-a2a-backend megamoe`` and DeepGEMM usable, a layer whose plan
(``layers/moe/expert_plan.py``) keeps DeepGEMM's layout has this rank's experts re-laid out once
by :func:`build_mega_moe_experts_weights` (MXFP4 as stored for Blackwell's ``fp8_fp4_mega_moe``,
FP8 for Hopper's ``fp8_mega_moe``: an FP8 checkpoint, or MXFP4 converted at load) and keeps that
layout as its only copy. The kernel the runtime picks depends on the GPU, so the format is
checked against it here too.

A caller's own builder (``LoadOptions.mega_weight_builder``) on a layer whose plan keeps no
MegaMoE layout gets the checkpoint experts as stored and its result is set beside the runner's
weights (:func:`attach_mega_weights`); a malformed tensor is a load error naming the layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from sglang.srt.layers.deep_gemm_adapter import get_deep_gemm
from sglang.srt.layers.moe import mega_moe as _mega_moe
from sglang.srt.layers.moe.expert_plan import DeviceFacts
from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.layers.moe.mega_moe_weights import (
    MegaMoEFormatError,
    MegaMoEWeightError,
    build_mega_moe_experts_weights,
)
from sglang.srt.layers.quantization.mxfp4 import MXFP4_DTYPES
from sglang.srt.model_loader.checkpoint_experts import CheckpointExperts
from sglang.srt.model_loader.checkpoint_index import WeightLoadError
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)

# (layer id, this rank's stacked checkpoint experts: w13, w2 and their scales or None) -> weights
MegaWeightBuilder = Callable[[int, dict[str, torch.Tensor | None]], Any]

# What each MegaMoE kernel (named by ``mega_moe_kernel_name``) takes: "MXFP4" means packed
# uint8/int8 experts, "FP8" float8_e4m3fn ones.
_KERNEL_EXPERT_FORMAT = {"fp8_fp4_mega_moe": "MXFP4", "fp8_mega_moe": "FP8"}


def deep_gemm_mega_weight_builder(deep_gemm: Any, arch: int) -> MegaWeightBuilder:
    """The builder for a GPU of compute capability ``arch`` (e.g. 100, 90)."""

    def build(layer_id: int, raw: dict[str, torch.Tensor | None]) -> Any:
        w13 = raw["w13"]
        assert w13 is not None
        # The kernel the runtime will run on this GPU, so the layout built here is the one it reads.
        kernel = _mega_moe.mega_moe_kernel_name(arch)
        needs = _KERNEL_EXPERT_FORMAT[kernel]
        have = (
            "MXFP4"
            if w13.dtype in MXFP4_DTYPES
            else "FP8"
            if w13.dtype == torch.float8_e4m3fn
            else None
        )
        # Other dtypes (bf16) have no MegaMoE layout at all: build_mega_moe_experts_weights says so.
        if have is not None and have != needs:
            raise MegaMoEFormatError(
                f"DeepGEMM's {kernel} on sm_{arch} takes {needs} experts; these are {w13.dtype}"
            )
        return build_mega_moe_experts_weights(
            deep_gemm, w13, raw["w2"], raw["w13_scale"], raw["w2_scale"]
        )  # type: ignore[arg-type]

    return build


def default_mega_weight_builder(device: torch.device) -> MegaWeightBuilder | None:
    """DeepGEMM's layout for this GPU, or ``None`` (one log line) when DeepGEMM is unusable."""
    deep_gemm = get_deep_gemm()
    if deep_gemm is None:
        log_once(logger, logging.WARNING, "MegaMoE weights are not built: DeepGEMM is unusable")
        return None
    # The same arch lookup the runtime uses to pick the kernel.
    arch = _mega_moe.device_sm_info(device if device.type == "cuda" else None).arch
    return deep_gemm_mega_weight_builder(deep_gemm, arch)


def loader_device_facts(device: torch.device, *, needs_deep_gemm: bool) -> DeviceFacts:
    """The facts the expert plans of a model on ``device`` are made from: the GPU's compute
    capability, DeepGEMM's usability (looked up only when ``needs_deep_gemm``: a MegaMoE or
    deep_gemm layer) and whether the Triton W4A16 MXFP4 kernel is installed. The same lookups as
    :func:`default_mega_weight_builder`, so the plan and the layout it builds agree."""
    deep_gemm = get_deep_gemm() if needs_deep_gemm else None
    on_gpu = device.type == "cuda"
    arch = 0
    if on_gpu or deep_gemm is not None:
        arch = _mega_moe.device_sm_info(device if on_gpu else None).arch
    return DeviceFacts(
        name=f"{device.type} (sm_{arch})" if arch else device.type,
        kind=device.type,
        arch=arch,
        deep_gemm=deep_gemm is not None,
    )


def attach_mega_weights(
    experts: FusedMoE, layer_id: int, ckpt: CheckpointExperts, builder: MegaWeightBuilder | None
) -> bool:
    """Build one layer's MegaMoE weights from this rank's checkpoint experts with a caller's own
    ``builder`` and set them beside the runner's. True when set; False (the layer keeps the
    normal path) when its backend is not MegaMoE's, no builder, or a format with no MegaMoE
    layout (logged once)."""
    if builder is None or not experts.uses_mega_weights:
        return False
    raw = {"w13": ckpt.w13, "w2": ckpt.w2, "w13_scale": ckpt.w13_scale, "w2_scale": ckpt.w2_scale}
    try:
        experts.set_mega_weights(builder(layer_id, raw))
    except MegaMoEFormatError as exc:
        log_once(
            logger,
            logging.WARNING,
            f"MegaMoE weights are not built ({ckpt.fmt.value} experts): {exc}; "
            "the MoE layers use the normal path",
        )
        return False
    except MegaMoEWeightError as exc:
        raise WeightLoadError(f"layer {layer_id} MegaMoE weights: {exc}") from None
    return True


def log_mega_weights_built(model_name: str, built: int, total: int) -> None:
    if built:
        logger.info(
            f"{model_name}: built DeepGEMM MegaMoE expert weights for {built} of {total} MoE layers"
        )
