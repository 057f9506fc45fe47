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

    def is_available(self, device: torch.device) -> tuple[bool, str]:
        if device.type != "cuda":
            return False, "the triton MoE runner needs a CUDA device"
        return True, ""

    def run(
        self,
        hidden: torch.Tensor,
        topk: TopKOutput,
        weights: ExpertWeights,
        *,
        inplace: bool = False,
    ) -> torch.Tensor:
        return self._run_fused(_fused_experts(), hidden, topk, weights, inplace)
