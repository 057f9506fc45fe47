"""The MegaMoE backend where DeepGEMM's cannot run: our Triton persistent kernel
(``kernels/ops/moe/mega_moe_triton.py``), one launch for the routed experts on the MegaMoE SM
budget, on a single GPU.

Across ranks the kernel does no dispatch or combine, so with more than one rank the layer falls
back to its normal path (runner + all-reduce) with a log line, as it does for DeepGEMM's
unusable cases. The output is allocated like every runner's final output (the symmetric pool
when ``--enable-symm-mem`` is on and allocation is symmetric).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner.base import allocate_moe_output
from sglang.srt.layers.moe.sm_budget import mega_moe_sm_budget
from sglang.srt.utils.device import device_sm_info
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)

_launches = itertools.count(1)
# Rows an expert gets (T * top_k / E) inside each of the kernel's tile steps.
_TILE_STEP_ROWS = (0.25, 8.0, 32.0, 64.0)


def triton_mega_unavailable_reason(
    device: torch.device, weights: ExpertWeights | None, group_size: int, top_k: int
) -> str | None:
    """Why our Triton MegaMoE cannot take a layer with these experts on ``device`` in a group of
    ``group_size`` ranks, whatever the batch (None: it can; the kernel picks its tiles from the
    batch's size, and every tile it picks fits these widths)."""
    if weights is None:
        return "the layer has no expert weights"
    if device.type != "cuda":
        return "the Triton MegaMoE kernel needs a CUDA device"
    if group_size > 1:
        return (
            "the Triton MegaMoE kernel runs on one GPU and this expert-parallel group has "
            f"{group_size} ranks"
        )
    if weights.is_mega:
        return "the experts are kept in DeepGEMM's MegaMoE layout, which it does not read"
    if weights.w13.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        return (
            f"expert weights of dtype {weights.w13.dtype} (bf16, fp16 or FP8 128x128 blocks "
            "supported)"
        )
    from sglang.kernels.fit.decide import limits_for
    from sglang.kernels.ops.moe.mega_moe_triton import (
        fit_config,
        get_mega_config,
        mega_unfit_reason,
        unsupported_reason,
    )

    fp8 = weights.w13.dtype == torch.float8_e4m3fn
    e, two_i, h = weights.w13.shape
    block = tuple(weights.block_shape or (128, 128))
    limits = limits_for(device)
    # The tiles step with the rows an expert gets (T * top_k / E): one batch size per step.
    for rows in _TILE_STEP_ROWS:
        tokens = max(1, int(rows * e / top_k))
        cfg = fit_config(get_mega_config(tokens, e, top_k, fp8), h, two_i // 2, fp8)
        why = unsupported_reason(
            h, two_i // 2, fp8, (int(block[0]), int(block[1])), cfg
        ) or mega_unfit_reason(cfg, fp8, limits)
        if why is not None:
            return why
    return None


def run_triton_mega_routed(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    *,
    activation: str,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """Routed experts through one Triton MegaMoE launch on the SM budget (tiles by the batch's
    size); combined rows. The top-k weights already hold the routed scaling."""
    from sglang.kernels.ops.moe.mega_moe_triton import MegaMoELaunch, mega_fused_experts

    info = device_sm_info(x.device)
    budget = mega_moe_sm_budget(x.device) or info.num_sms
    log_once(
        logger,
        logging.INFO,
        f"MegaMoE backend: Triton persistent kernel (DeepGEMM unusable) on a {budget}-SM budget "
        f"(physical {info.num_sms}, SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS="
        f"{envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.get()})",
    )
    launch: list[MegaMoELaunch] = []
    out = allocate_moe_output(x)  # the final output, allocated like every runner's
    mega_fused_experts(
        x,
        weights.w13,
        weights.w2,
        topk_weights,
        topk_ids,
        num_sms=budget,
        activation=activation,
        swiglu_limit=swiglu_limit,
        w13_scale=weights.w13_scale,
        w2_scale=weights.w2_scale,
        block_shape=weights.block_shape,
        out=out,
        timeout_ms=envs.SGLANG_MEGA_MOE_WAIT_TIMEOUT_MS.get(),
        launch_info=launch,
    )
    _maybe_check(launch)
    return out


def _maybe_check(launch: list[Any]) -> None:
    """Read the kernel's status every N launches (a host sync), never during graph capture."""
    every = envs.SGLANG_MEGA_MOE_STATUS_CHECK_INTERVAL.get()
    n = next(_launches)
    due = n == 1 or (every > 0 and n % every == 0)  # the first launch, then every N-th
    if not launch or every == 0 or not due or torch.cuda.is_current_stream_capturing():
        return
    launch[-1].check()
