"""The reference runner: plain torch, any device. The correctness oracle and the CPU path."""

from __future__ import annotations

import torch

from sglang.kernels.ops.moe.fused_moe import fused_experts_torch
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner.base import MoERunner, allocate_moe_output
from sglang.srt.layers.moe.topk import TopKOutput


class TorchMoERunner(MoERunner):
    name = "torch"

    def run(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights, *, inplace: bool = False
    ) -> torch.Tensor:
        out = hidden if inplace else allocate_moe_output(hidden)
        return fused_experts_torch(
            hidden,
            weights.w13,
            weights.w2,
            topk.topk_weights,
            topk.topk_ids,
            activation=self.config.activation,
            swiglu_limit=self.config.swiglu_limit,
            w13_scale=weights.w13_scale,
            w2_scale=weights.w2_scale,
            block_shape=weights.block_shape,
            inplace=inplace,
            out=None if inplace else out,
        )
