"""The reference runner: plain torch, any device. The correctness oracle and the CPU path."""

from __future__ import annotations

import torch

from sglang.kernels.ops.moe.fused_moe import fused_experts_torch
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner.base import MoERunner
from sglang.srt.layers.moe.topk import TopKOutput


class TorchMoERunner(MoERunner):
    name = "torch"
    capture_unsafe_reason = (
        "the torch MoE runner syncs with the host (it loops over the routed experts it reads back)"
    )

    def run_into(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights, out: torch.Tensor
    ) -> torch.Tensor:
        return self._run_fused(fused_experts_torch, hidden, topk, weights, out)
