"""Our fused-MoE Triton kernels (bf16 and FP8 128x128 blocks), in place or into a pool output."""

from __future__ import annotations

from collections.abc import Callable

import torch

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

    def run(
        self,
        hidden: torch.Tensor,
        topk: TopKOutput,
        weights: ExpertWeights,
        *,
        inplace: bool = False,
    ) -> torch.Tensor:
        return self._run_fused(_fused_experts(), hidden, topk, weights, inplace)
