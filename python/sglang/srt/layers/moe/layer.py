"""The fused-MoE layer: routed-expert weights, the runner that computes them and the a2a backend
(``--moe-a2a-backend``) that places them, dispatches rows to them and combines their outputs.

``forward`` is the same for every backend: dispatch -> runner -> combine (routing is the
model's). Where the experts sit and which all-reduce runs, if any, is the backend's
(:mod:`sglang.srt.layers.moe.a2a`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.a2a import MoEA2ABackend, create_a2a_backend
from sglang.srt.layers.moe.expert_plan import (
    DeviceFacts,
    ExpertPlan,
    ExpertShape,
    MegaKernelChoice,
    plan_experts,
    resolve_runner,
)
from sglang.srt.layers.moe.expert_weights import ExpertWeights, WeightFormat
from sglang.srt.layers.moe.fused_moe_config import A2ABackend, FusedMoEConfig
from sglang.srt.layers.moe.mega_moe import MegaMoEParams
from sglang.srt.layers.moe.mega_moe_weights import MegaWeights
from sglang.srt.layers.moe.moe_runner import MoERunConfig, MoERunner, create_moe_runner
from sglang.srt.layers.moe.moe_runner.on_use import run_on_used_experts
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)

__all__ = ["A2ABackend", "FusedMoE", "FusedMoEConfig"]


class FusedMoE(nn.Module):
    def __init__(
        self,
        config: FusedMoEConfig,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = torch.device(device)
        self.a2a: MoEA2ABackend = create_a2a_backend(
            config, tp_rank=tp_rank, tp_size=tp_size, device=self.device
        )
        name = resolve_runner(config.runner, self.device.type)
        self.runner: MoERunner = create_moe_runner(
            name, MoERunConfig(config.activation, config.swiglu_limit)
        )
        why = self.runner.unavailable_reason(self.device)
        if why is not None:
            raise ValueError(f"--moe-runner-backend {name} cannot run here: {why}")
        self.weights: ExpertWeights | None = None
        self.expert_plan: ExpertPlan | None = None
        log_once(
            logger,
            logging.INFO,
            f"MoE runner: {name} (requested {config.runner}), a2a: {config.a2a_backend}",
        )

    @classmethod
    def from_spec(
        cls,
        spec: LayerBuildSpec,
        *,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        activation: str,
        swiglu_limit: float | None = None,
    ) -> FusedMoE:
        """A model's routed experts of these shapes; the runner, the a2a backend and this rank's
        place come from ``spec``."""
        config = FusedMoEConfig(
            num_experts=num_experts,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            top_k=top_k,
            activation=activation,
            swiglu_limit=swiglu_limit,
            runner=spec.moe_runner,
            a2a_backend=spec.a2a_backend,
            ep_size=spec.moe_ep_size,
        )
        return cls(config, tp_rank=spec.tp_rank, tp_size=spec.tp_size, device=spec.device)

    def shared_expert_spec(self, spec: LayerBuildSpec) -> LayerBuildSpec:
        """``spec`` at the place the a2a backend gives the block's shared experts."""
        return spec.with_tp(*self.a2a.shared_expert_tp)

    @property
    def expert_parallel(self) -> bool:
        return self.a2a.expert_parallel

    @property
    def uses_mega_weights(self) -> bool:
        """Whether the loader builds this layer's DeepGEMM MegaMoE weights."""
        return self.a2a.uses_mega_weights

    @property
    def local_experts(self) -> range:
        return self.a2a.local_experts

    @property
    def local_intermediate(self) -> range:
        return self.a2a.local_intermediate

    def expert_shape(self) -> ExpertShape:
        c = self.config
        return ExpertShape(
            num_experts=c.num_experts,
            hidden=c.hidden_size,
            intermediate=c.intermediate_size,
            local_intermediate=len(self.local_intermediate),
            top_k=c.top_k,
            activation=c.activation,
            swiglu_limit=c.swiglu_limit,
        )

    def plan_experts(self, fmt: WeightFormat, dtype: torch.dtype, facts: DeviceFacts) -> ExpertPlan:
        """Decide (and keep) how this layer holds and runs ``fmt`` experts on a model of
        ``dtype`` on a device with ``facts`` (:func:`~.expert_plan.plan_experts`)."""
        self.expert_plan = plan_experts(
            runner=self.config.runner,
            a2a=self.config.a2a_backend,
            fmt=fmt,
            dtype=dtype,
            facts=facts,
            shape=self.expert_shape(),
        )
        return self.expert_plan

    def load_weights(self, full: ExpertWeights) -> None:
        """Take the full (all experts, unsharded) weights and keep this rank's part."""
        c = self.config
        want = (c.num_experts, c.intermediate_size, c.hidden_size)
        got = (full.num_experts, full.intermediate_size, full.hidden_size)
        if got != want:
            raise ValueError(
                f"MoE weights hold (experts, intermediate, hidden) {got}, expected {want}"
            )
        # This rank's experts (all of them under TP), then its slice of each over the ranks
        # that share them (the TP group under TP, the MoE-TP group under EP, none when whole).
        part = full.experts(self.local_experts).shard(self.a2a.moe_tp_rank, self.a2a.moe_tp_size)
        self.load_local_weights(part)

    def load_local_weights(self, part: ExpertWeights) -> None:
        """Take weights already cut to this rank's part (``local_experts`` x
        ``local_intermediate``), in any resident format and layout: loaders slice quantised
        checkpoints as stored."""
        want = (len(self.local_experts), len(self.local_intermediate), self.config.hidden_size)
        got = (part.num_experts, part.intermediate_size, part.hidden_size)
        if got != want:
            raise ValueError(
                f"this rank's MoE weights hold (experts, intermediate, hidden) {got}, expected "
                f"{want}"
            )
        self.weights = part.to(self.device)

    @property
    def mega_params(self) -> MegaMoEParams:
        """What the MegaMoE kernels are told about this layer (fixed by the config)."""
        c = self.config
        return MegaMoEParams(
            c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.activation, c.swiglu_limit
        )

    @property
    def mega_weights(self) -> MegaWeights | None:
        """DeepGEMM-layout weights ``((l1, l1_sf), (l2, l2_sf))`` the a2a backend's MegaMoE
        kernel reads: those built beside the runner's, or the resident experts themselves when
        they are kept in that layout; None for a backend that runs no MegaMoE kernel."""
        return self.a2a.mega_weights(self.weights)

    @property
    def mega_weights_beside(self) -> MegaWeights | None:
        """MegaMoE weights set beside the runner's (:meth:`set_mega_weights`), if any."""
        return self.a2a.mega_weights(None)

    def set_mega_weights(self, mega_weights: MegaWeights | None) -> None:
        """MegaMoE weights kept beside the runner's (a loader's own builder, tests), for an a2a
        backend that runs the MegaMoE kernel; loaders that keep the MegaMoE layout as the only
        copy load it as ``weights`` instead."""
        self.a2a.set_mega_weights(mega_weights)

    @property
    def capture_unsafe_reason(self) -> str | None:
        """Why a decode step through this layer cannot be captured in a CUDA graph (None: it
        can): the a2a backend's reason, the runner's, or a runner that reads these experts on
        use. The MegaMoE layout's on-use reads are the kernel's fallback, which graph-sized
        batches never take (it raises if one does)."""
        if self.a2a.capture_unsafe_reason is not None:
            return self.a2a.capture_unsafe_reason
        if not self.runner.capture_safe:
            return self.runner.capture_unsafe_reason
        w = self.weights
        if w is not None and not w.is_mega:
            why = self.runner.unreadable_reason(w)
            if why is not None:
                return (
                    f"the {self.runner.name} MoE runner reads these experts on use ({why}), "
                    "which reads the routing back to the host"
                )
        return None

    def _local_weights(self, caller: str) -> ExpertWeights:
        if self.weights is None:
            raise RuntimeError(f"FusedMoE.{caller} before load_weights")
        return self.weights

    def run_runner(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights, *, inplace: bool
    ) -> torch.Tensor:
        """The runner on ``weights``, directly where it reads them, else on the experts this
        batch routes to, selected on use."""
        why = self.runner.unreadable_reason(weights)
        if why is None:
            return self.runner.run(hidden, topk, weights, inplace=inplace)
        return run_on_used_experts(self.runner, hidden, topk, weights, inplace=inplace, why=why)

    def forward(
        self, hidden: torch.Tensor, topk: TopKOutput, *, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``hidden [T, H]`` routed by ``topk`` -> complete ``[T, H]`` rows (reduced over the
        TP group where the backend's placement needs it), plus ``shared``: the shared expert's
        output on these rows, sharded as ``self.a2a.shared_expert_tp`` says."""
        weights = self._local_weights("forward")
        dispatched = self.a2a.dispatch(hidden, topk, weights)
        routed = dispatched.combined
        if routed is None:  # no fused kernel took the rows: the runner computes them
            routed = self.run_runner(
                dispatched.hidden, dispatched.topk, weights, inplace=dispatched.runner_inplace
            )
        return self.a2a.combine(routed, dispatched, shared=shared)

    def mega_kernel_for(self, hidden: torch.Tensor) -> MegaKernelChoice | None:
        """The MegaMoE kernel that takes ``hidden``'s batch, asked once a batch: the models then
        call their MegaMoE call site with it (:meth:`forward_mega`); None (this layer's a2a
        backend runs no MegaMoE kernel, or none takes the batch): :meth:`forward`."""
        return self.a2a.mega_kernel_for(hidden, self._local_weights("mega_kernel_for"))

    def forward_mega(
        self, hidden: torch.Tensor, topk: TopKOutput, kernel: MegaKernelChoice
    ) -> torch.Tensor:
        """The MegaMoE ``kernel`` (:meth:`mega_kernel_for`'s choice) alone on ``hidden`` routed
        by ``topk``: this rank's rows combined over the expert-parallel group (the models'
        MegaMoE call sites, DeepSeek V4's ``_run_mega_routed`` and Kimi K3's
        ``_forward_mega_experts``). Raises, naming why, on a layer whose a2a backend runs no
        MegaMoE kernel."""
        return self.a2a.run_mega_moe(hidden, topk, self._local_weights("forward_mega"), kernel)

    def mega_backend_summary(self, dtype: torch.dtype) -> str | None:
        """Which fused kernel this layer's decode-sized batches take, and why (startup log)."""
        return self.a2a.kernel_summary(self._local_weights("mega_backend_summary"), dtype)
