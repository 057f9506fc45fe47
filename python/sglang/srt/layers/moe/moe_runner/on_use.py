"""A runner on the experts a batch routes to, selected from the resident copy on use.

Where a runner cannot read the resident experts (MXFP4 for a runner without an MXFP4 kernel, or
DeepGEMM's MegaMoE layout, the one copy a MegaMoE layer keeps), the layer hands it only the
experts this batch routes to: selected (a copy of those experts, standard layout), MXFP4
dequantised to the activation dtype (exact: an E2M1 value times a power of two fits bf16, fp16
and fp32) unless the runner reads packed MXFP4, and the top-k ids renumbered onto them. The
runner then computes exactly what it would on all experts. The selection reads the routed ids
back to the host, so this path is never captured in a CUDA graph.
"""

from __future__ import annotations

import logging

import torch

from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner.base import MoERunner
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)


def used_experts(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, local)``: the distinct experts in ``topk_ids`` (ascending; ids outside
    ``[0, num_experts)`` are unrouted and dropped) and ``topk_ids`` renumbered onto them (-1 for
    unrouted), so expert ``ids[j]`` is expert ``j`` of the selection."""
    flat = topk_ids.long()
    routed = (flat >= 0) & (flat < num_experts)
    ids = torch.unique(flat[routed])  # sorted: the experts keep their relative order
    lookup = torch.full((num_experts,), -1, dtype=torch.long, device=topk_ids.device)
    lookup[ids] = torch.arange(ids.numel(), device=topk_ids.device)
    local = torch.where(routed, lookup[flat.clamp(0, num_experts - 1)], -1)
    return ids, local.to(topk_ids.dtype)


def select_for_runner(
    runner: MoERunner, weights: ExpertWeights, ids: torch.Tensor, dtype: torch.dtype
) -> ExpertWeights:
    """Experts ``ids`` of ``weights`` in a form ``runner`` reads: standard layout, MXFP4 kept
    packed if the runner reads it, else dequantised to ``dtype``."""
    picked = weights.select(ids)
    if picked.is_mxfp4 and runner.unreadable_reason(picked) is not None:
        picked = picked.unpacked(dtype)
    why = runner.unreadable_reason(picked)
    if why is not None:
        raise RuntimeError(f"the {runner.name} MoE runner cannot read the selected experts: {why}")
    return picked


def run_on_used_experts(
    runner: MoERunner,
    hidden: torch.Tensor,
    topk: TopKOutput,
    weights: ExpertWeights,
    *,
    inplace: bool,
    why: str,
) -> torch.Tensor:
    """``runner.run`` on only the experts ``topk`` routes to (see the module docstring); ``why``
    the runner cannot read ``weights`` directly, logged once."""
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the {runner.name} MoE runner reads these experts on use ({why}), which reads the "
            "routing back to the host and cannot be captured in a CUDA graph"
        )
    log_once(
        logger,
        logging.INFO,
        f"MoE runner {runner.name}: {why}; it reads the experts each batch routes to, selected "
        f"from the resident {weights.describe()} copy on use",
    )
    ids, local = used_experts(topk.topk_ids, weights.num_experts)
    if ids.numel() == 0:  # nothing routed here: one expert keeps the shapes valid, none is read
        ids = ids.new_zeros(1)
    picked = select_for_runner(runner, weights, ids, hidden.dtype)
    return runner.run(hidden, TopKOutput(topk.topk_weights, local), picked, inplace=inplace)
