"""Our fused-MoE Triton kernels: bf16 and FP8 128x128 blocks (``fused_experts``), and MXFP4
experts read 4-bit in the kernel (``fused_experts_mxfp4``, W4A16), in place or into a pool
output."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang.kernels.fit.decide import unfit_reason
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner.base import MoERunner
from sglang.srt.layers.moe.topk import TopKOutput


def _fused_experts() -> Callable[..., torch.Tensor]:  # lazily: triton is not needed on CPU
    from sglang.kernels.ops.moe.fused_moe import fused_experts

    return fused_experts


class TritonMoERunner(MoERunner):
    name = "triton"
    # Fixed-size alignment (no host read of the routing), shape-only tile choice.
    capture_safe = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "the triton MoE runner needs a CUDA device"
        return None

    def unreadable_reason(self, weights: ExpertWeights) -> str | None:
        # The W4A16 kernel reads MXFP4 in the checkpoint layout and in DeepGEMM's SM100 MegaMoE
        # layout (the single resident copy on Blackwell), so neither is copied on use.
        if weights.is_mxfp4:
            # after a build failure, the experts a batch routes to are dequantised on use
            return unfit_reason("fused_moe_mxfp4")
        return super().unreadable_reason(weights)

    def run_into(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights, out: torch.Tensor
    ) -> torch.Tensor:
        if weights.is_mxfp4:
            return self._run_mxfp4(hidden, topk, weights, out)
        return self._run_fused(_fused_experts(), hidden, topk, weights, out)

    def _run_mxfp4(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights, out: torch.Tensor
    ) -> torch.Tensor:
        from sglang.kernels.ops.moe.fused_moe_mxfp4 import fused_experts_mxfp4_weights
        from sglang.kernels.ops.moe.mxfp4_weights import (
            PLAIN_LAYOUT,
            Mxfp4MoeWeights,
            mega_moe_mxfp4_weights,
        )

        assert weights.w13_scale is not None and weights.w2_scale is not None
        if weights.is_mega:
            bundle = mega_moe_mxfp4_weights(*weights.mega_weights)
        else:
            bundle = Mxfp4MoeWeights(
                weights.w13, weights.w2, weights.w13_scale, weights.w2_scale, PLAIN_LAYOUT
            )
        return fused_experts_mxfp4_weights(
            hidden,
            bundle,
            topk.topk_weights,
            topk.topk_ids,
            activation=self.config.activation,
            swiglu_limit=self.config.swiglu_limit,
            inplace=out is hidden,
            out=out,
        )
