"""Our fused-MoE Triton kernels: bf16 and FP8 128x128 blocks (``fused_experts``), and MXFP4
experts read 4-bit in the kernel (``fused_experts_mxfp4``, W4A16), in place or into a pool
output."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner.base import MoERunner, allocate_moe_output
from sglang.srt.layers.moe.topk import TopKOutput

MXFP4_KERNEL_MODULE = "sglang.kernels.ops.moe.fused_moe_mxfp4"


def _fused_experts() -> Callable[..., torch.Tensor]:  # lazily: triton is not needed on CPU
    from sglang.kernels.ops.moe.fused_moe import fused_experts

    return fused_experts


@functools.cache
def fused_experts_mxfp4_kernel() -> Callable[..., torch.Tensor] | None:
    """The Triton W4A16 MXFP4 kernel (``fused_experts_mxfp4``), or None where it is not
    installed. The one place the engine imports it."""
    import importlib

    try:
        module = importlib.import_module(MXFP4_KERNEL_MODULE)
    except ImportError:
        return None
    kernel = getattr(module, "fused_experts_mxfp4", None)
    return kernel if callable(kernel) else None


class TritonMoERunner(MoERunner):
    name = "triton"
    # Fixed-size alignment (no host read of the routing), shape-only tile choice.
    capture_safe = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "the triton MoE runner needs a CUDA device"
        return None

    def unreadable_reason(self, weights: ExpertWeights) -> str | None:
        if weights.is_mxfp4 and not weights.is_mega:
            if fused_experts_mxfp4_kernel() is None:
                return f"the Triton W4A16 MXFP4 kernel ({MXFP4_KERNEL_MODULE}) is not installed"
            return None
        return super().unreadable_reason(weights)

    def run(
        self,
        hidden: torch.Tensor,
        topk: TopKOutput,
        weights: ExpertWeights,
        *,
        inplace: bool = False,
    ) -> torch.Tensor:
        if weights.is_mxfp4:
            return self._run_mxfp4(hidden, topk, weights, inplace)
        return self._run_fused(_fused_experts(), hidden, topk, weights, inplace)

    def _run_mxfp4(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights, inplace: bool
    ) -> torch.Tensor:
        kernel = fused_experts_mxfp4_kernel()
        if kernel is None or weights.is_mega:
            raise RuntimeError(f"the triton runner cannot read {weights.describe()} experts")
        assert weights.w13_scale is not None and weights.w2_scale is not None
        return kernel(
            hidden,
            weights.w13,
            weights.w2,
            weights.w13_scale,
            weights.w2_scale,
            topk.topk_weights,
            topk.topk_ids,
            activation=self.config.activation,
            swiglu_limit=self.config.swiglu_limit,
            inplace=inplace,
            out=None if inplace else allocate_moe_output(hidden),
        )
