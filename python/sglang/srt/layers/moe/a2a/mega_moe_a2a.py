"""``--moe-a2a-backend megamoe``: expert-parallel experts (``E / tp`` whole experts a rank).
The MegaMoE kernel (DeepGEMM's, :mod:`..mega_moe`, or our Triton one on one GPU,
:mod:`..mega_moe_triton_backend`) dispatches, computes and combines over the group itself, so
nothing is reduced. Which kernel takes a batch is the layer's MegaMoE plan
(:func:`~sglang.srt.layers.moe.expert_plan.plan_mega_kernel`), made once per layer. When no
kernel can take a batch, the runner computes this rank's experts on ids remapped to them (the
others -1) and the partial sums are all-reduced. The shared expert is replicated and added after
the combine.

This backend owns what only MegaMoE needs: the kernel's parameters (``params``) and the
DeepGEMM-layout weights built beside the runner's (``mega_weights_beside``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from sglang.srt.distributed.parallel_state import get_tp_group_or_none
from sglang.srt.layers.deep_gemm_adapter import get_deep_gemm

# The two kernels' modules by name: tests stand in for a kernel at its own module.
from sglang.srt.layers.moe import mega_moe, mega_moe_triton_backend
from sglang.srt.layers.moe.a2a.base import DispatchOutput, MoEA2ABackend, reduce_partial_sums
from sglang.srt.layers.moe.expert_plan import MegaKernelChoice, MegaKernelPlan, plan_mega_kernel
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.fused_moe_config import FusedMoEConfig
from sglang.srt.layers.moe.mega_moe import MegaMoEParams, kernel_arch, mega_moe_max_tokens
from sglang.srt.layers.moe.mega_moe_weights import MegaWeights
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)


def choose_mega_kernel(
    deep_gemm: Any,
    group: Any,
    x: torch.Tensor,
    mega_weights: MegaWeights | None,
    params: MegaMoEParams,
    *,
    device: torch.device | None = None,
    local_weights: ExpertWeights | None = None,
) -> MegaKernelChoice:
    """The MegaMoE kernel that takes ``x``'s batch (the decision the forward, the startup line
    and ``check_env`` share): DeepGEMM's when it can, else ours on one GPU, else none."""
    plan = _plan(deep_gemm, group, mega_weights, params, device, local_weights)
    return plan.kernel_for(x.shape[0], x.dtype)


def try_run_mega_routed(
    deep_gemm: Any,
    group: Any,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    mega_weights: MegaWeights | None,
    params: MegaMoEParams,
    *,
    device: torch.device | None = None,
    local_weights: ExpertWeights | None = None,
) -> torch.Tensor | None:
    """The MegaMoE kernel on this batch when one can take it (combined rows), else ``None`` (the
    caller runs the normal path) after one log line saying why."""
    plan = _plan(deep_gemm, group, mega_weights, params, device, local_weights)
    kernel = _MegaKernel(plan, deep_gemm, group, mega_weights, params, device, local_weights)
    return kernel.combined_rows(x, topk_ids, topk_weights)


def _plan(
    deep_gemm: Any,
    group: Any,
    mega_weights: MegaWeights | None,
    params: MegaMoEParams,
    device: torch.device | None,
    local_weights: ExpertWeights | None,
) -> MegaKernelPlan:
    return plan_mega_kernel(
        deep_gemm,
        arch=kernel_arch(deep_gemm, _cuda_or_none(device)),
        group_size=int(getattr(group, "world_size", 1)) if group is not None else 1,
        params=params,
        device=device if device is not None else torch.device("cpu"),
        mega_weights=mega_weights,
        local_weights=local_weights,
    )


def _cuda_or_none(device: torch.device | None) -> torch.device | None:
    return device if device is not None and device.type == "cuda" else None


@dataclass(frozen=True)
class _MegaKernel:
    """A layer's MegaMoE plan with what running it takes (DeepGEMM, the group, the weights)."""

    plan: MegaKernelPlan
    deep_gemm: Any
    group: Any
    mega_weights: MegaWeights | None
    params: MegaMoEParams
    device: torch.device | None
    local_weights: ExpertWeights | None

    def combined_rows(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor | None:
        """Combined rows from the kernel the plan picks for ``x``'s batch, or None after one log
        line saying why none takes it."""
        choice = self.plan.kernel_for(x.shape[0], x.dtype)
        if choice.backend == "none":
            log_once(
                logger, logging.WARNING, f"MegaMoE falls back to the normal MoE path: {choice.why}"
            )
            return None
        return self.launch(choice, x, topk_ids, topk_weights)

    def launch(
        self,
        choice: MegaKernelChoice,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Combined rows from the kernel ``choice`` names (``deep_gemm`` or ``triton``)."""
        log_once(logger, logging.INFO, f"MegaMoE backend: {choice.describe()}")
        if choice.backend == "deep_gemm":
            assert self.mega_weights is not None
            rows = mega_moe.run_mega_routed_experts(
                self.deep_gemm,
                self.group,
                x,
                topk_ids,
                topk_weights,
                self.mega_weights[0],
                self.mega_weights[1],
                self.params,
                device=_cuda_or_none(self.device),
            )
            return rows.to(x.dtype)  # the kernel writes bf16 (a no-op for a bf16 model)
        assert choice.backend == "triton" and self.local_weights is not None
        return mega_moe_triton_backend.run_triton_mega_routed(
            x,
            topk_ids,
            topk_weights,
            self.local_weights,
            activation=self.params.activation,
            swiglu_limit=self.params.activation_clamp,
        )


class MegaMoEA2A(MoEA2ABackend):
    name = "megamoe"
    expert_parallel = True
    partial_ep_unsupported = (
        "the MegaMoE kernel dispatches, computes and combines whole experts over the whole TP "
        "group in one fused call, with no reduce of TP-sliced experts' partial sums over part "
        "of the group; use --moe-a2a-backend ep for --ep-size < --tp-size"
    )
    uses_mega_weights = True

    def __init__(
        self, config: FusedMoEConfig, *, tp_rank: int, tp_size: int, device: torch.device
    ) -> None:
        super().__init__(config, tp_rank=tp_rank, tp_size=tp_size, device=device)
        c = config
        # What the MegaMoE kernels are told about this layer (fixed by the config).
        self.params = MegaMoEParams(
            c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.activation, c.swiglu_limit
        )
        # DeepGEMM-layout weights built beside the runner's (a loader's builder, tests).
        self.mega_weights_beside: MegaWeights | None = None
        # The MegaMoE kernel plan and what it was made from (compared by identity: other
        # weights, another DeepGEMM module or group, or another token cap make a new plan).
        self._kernel: tuple[tuple[object, ...], _MegaKernel] | None = None

    def set_mega_weights(self, mega_weights: MegaWeights | None) -> None:
        self.mega_weights_beside = mega_weights

    def mega_weights(self, weights: ExpertWeights | None) -> MegaWeights | None:
        """The DeepGEMM-layout weights the kernel reads: those built beside, else the resident
        experts themselves when they are kept in that layout."""
        if self.mega_weights_beside is not None:
            return self.mega_weights_beside
        if weights is not None and weights.is_mega:
            return weights.mega_weights
        return None

    def kernel(self, weights: ExpertWeights) -> _MegaKernel:
        """This layer's MegaMoE kernel plan for these experts (made once, kept)."""
        deep_gemm, group = get_deep_gemm(), get_tp_group_or_none()
        key = (weights, self.mega_weights_beside, deep_gemm, group, mega_moe_max_tokens())
        if self._kernel is None or any(
            a is not b and a != b for a, b in zip(key, self._kernel[0], strict=True)
        ):
            mega = self.mega_weights(weights)
            plan = _plan(deep_gemm, group, mega, self.params, self.device, weights)
            kernel = _MegaKernel(plan, deep_gemm, group, mega, self.params, self.device, weights)
            self._kernel = (key, kernel)
        return self._kernel[1]

    def dispatch(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights
    ) -> DispatchOutput:
        """DeepGEMM's kernel (buffer set-up and pre-dispatch outside the reserved-SM context,
        only the kernel inside it) or our Triton kernel; else the runner's rows."""
        kernel: _MegaKernel = self.kernel(weights)
        combined = kernel.combined_rows(hidden, topk.topk_ids, topk.topk_weights)
        if combined is not None:
            return DispatchOutput(hidden, topk, combined)
        return DispatchOutput(hidden, self._local_topk(topk))

    def mega_kernel_for(
        self, hidden: torch.Tensor, weights: ExpertWeights
    ) -> MegaKernelChoice | None:
        choice = self.kernel(weights).plan.kernel_for(hidden.shape[0], hidden.dtype)
        if choice.backend == "none":
            log_once(
                logger, logging.WARNING, f"MegaMoE falls back to the normal MoE path: {choice.why}"
            )
            return None
        return choice

    def run_mega_moe(
        self,
        hidden: torch.Tensor,
        topk: TopKOutput,
        weights: ExpertWeights,
        kernel: MegaKernelChoice,
    ) -> torch.Tensor:
        if kernel.backend == "none":
            raise RuntimeError(f"no MegaMoE kernel takes this batch: {kernel.why}")
        return self.kernel(weights).launch(kernel, hidden, topk.topk_ids, topk.topk_weights)

    def _local_topk(self, topk: TopKOutput) -> TopKOutput:
        """Remap global expert ids to this rank's experts; the others become -1 (skipped)."""
        r = self.local_experts
        ids = topk.topk_ids
        mine = (ids >= r.start) & (ids < r.stop)
        local = torch.where(mine, ids - r.start, torch.full_like(ids, -1))
        return TopKOutput(torch.where(mine, topk.topk_weights, 0.0), local)

    def combine_routed(self, routed_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        if dispatched.combined is None:  # the runner's partial sum over this rank's experts
            return reduce_partial_sums(routed_out, self.tp_size)
        return routed_out

    def kernel_summary(self, weights: ExpertWeights, dtype: torch.dtype) -> str | None:
        return self.kernel(weights).plan.kernel_for(1, dtype).describe()
