"""Our fused-MoE Triton kernels (bf16 and FP8 128x128 blocks), in place or into a pool output."""

from __future__ import annotations

import torch

from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner.base import MoERunner, allocate_moe_output
from sglang.srt.layers.moe.topk import TopKOutput


def _fused_experts():  # imported lazily: triton is not needed on CPU
    from sglang.kernels.ops.moe.fused_moe import fused_experts

    return fused_experts


class TritonMoERunner(MoERunner):
    name = "triton"

    def is_available(self, device: torch.device) -> tuple[bool, str]:
        if device.type != "cuda":
            return False, "the triton MoE runner needs a CUDA device"
        return True, ""

    def run(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights, *, inplace: bool = False
    ) -> torch.Tensor:
        # Non-in-place: the output comes from the pool scope; the kernel allocates only its
        # intermediate caches, on the default allocator.
        out = None if inplace else allocate_moe_output(hidden)
        return _fused_experts()(
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
            out=out,
        )
