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
from sglang.srt.layers.moe.a2a import MoEA2ABackend, RankExperts, create_a2a_backend
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.fused_moe_config import A2ABackend, FusedMoEConfig
from sglang.srt.layers.moe.mega_moe import MegaMoEParams
from sglang.srt.layers.moe.mega_moe_weights import MegaWeights
from sglang.srt.layers.moe.moe_runner import MoERunConfig, MoERunner, create_moe_runner
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)

__all__ = ["A2ABackend", "FusedMoE", "FusedMoEConfig", "resolve_runner_name"]


def resolve_runner_name(name: str, device: torch.device) -> str:
    """``auto`` -> triton on CUDA, torch elsewhere."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


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
        name = resolve_runner_name(config.runner, self.device)
        self.runner: MoERunner = create_moe_runner(
            name, MoERunConfig(config.activation, config.swiglu_limit)
        )
        why = self.runner.unavailable_reason(self.device)
        if why is not None:
            raise ValueError(f"--moe-runner-backend {name} cannot run here: {why}")
        self.weights: ExpertWeights | None = None
        self.mega_weights: MegaWeights | None = None
        c = config
        # What the MegaMoE kernels are told about this layer (fixed by the config).
        self.mega_params = MegaMoEParams(
            c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.activation, c.swiglu_limit
        )
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

    def load_weights(self, full: ExpertWeights) -> None:
        """Take the full (all experts, unsharded) weights and keep this rank's part."""
        c = self.config
        want = (c.num_experts, 2 * c.intermediate_size, c.hidden_size)
        if tuple(full.w13.shape) != want:
            raise ValueError(f"MoE w13 has shape {tuple(full.w13.shape)}, expected {want}")
        # This rank's experts (all of them under TP), then its slice of each over the ranks
        # that share them (the TP group under TP, the MoE-TP group under EP, none when whole).
        r = self.local_experts
        part = ExpertWeights(
            full.w13[r.start : r.stop],
            full.w2[r.start : r.stop],
            None if full.w13_scale is None else full.w13_scale[r.start : r.stop],
            None if full.w2_scale is None else full.w2_scale[r.start : r.stop],
        ).shard(self.a2a.moe_tp_rank, self.a2a.moe_tp_size)
        self.load_local_weights(part)

    def load_local_weights(self, part: ExpertWeights) -> None:
        """Take weights already cut to this rank's part (``local_experts`` x
        ``local_intermediate``): loaders slice quantised checkpoints before dequantising."""
        want = (len(self.local_experts), 2 * len(self.local_intermediate), self.config.hidden_size)
        if tuple(part.w13.shape) != want:
            raise ValueError(
                f"this rank's MoE w13 has shape {tuple(part.w13.shape)}, expected {want}"
            )
        self.weights = ExpertWeights(
            *(
                None if t is None else t.to(self.device)
                for t in (part.w13, part.w2, part.w13_scale, part.w2_scale)
            )
        )

    def set_mega_weights(self, mega_weights: MegaWeights | None) -> None:
        """DeepGEMM-layout weights ((l1, l1_sf), (l2, l2_sf)) for the MegaMoE kernel."""
        self.mega_weights = mega_weights

    def _rank_experts(self, caller: str) -> RankExperts:
        if self.weights is None:
            raise RuntimeError(f"FusedMoE.{caller} before load_weights")
        return RankExperts(self.weights, self.mega_weights, self.mega_params)

    def forward(
        self, hidden: torch.Tensor, topk: TopKOutput, *, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``hidden [T, H]`` routed by ``topk`` -> complete ``[T, H]`` rows (reduced over the
        TP group where the backend's placement needs it), plus ``shared``: the shared expert's
        output on these rows, sharded as ``self.a2a.shared_expert_tp`` says."""
        experts = self._rank_experts("forward")
        dispatched = self.a2a.dispatch(hidden, topk, experts)
        routed = dispatched.combined
        if routed is None:  # no fused kernel took the rows: the runner computes them
            routed = self.runner.run(
                dispatched.hidden,
                dispatched.topk,
                experts.weights,
                inplace=dispatched.runner_inplace,
            )
        return self.a2a.combine(routed, dispatched, shared=shared)

    def forward_mega(self, hidden: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """The models' MegaMoE call sites (``deepseek_v4_moe._run_mega_routed``,
        ``kimi_k3._forward_mega_experts``): :meth:`forward` on an expert-parallel layer, the
        routed rows combined over the group, the replicated shared expert left to the caller.
        Refuses a tensor-parallel layer, whose output would be a partial sum."""
        if not self.expert_parallel:
            raise RuntimeError(
                f"FusedMoE.forward_mega on a layer with a2a backend {self.a2a.name!r}, which "
                "does not place whole experts"
            )
        return self.forward(hidden, topk)

    def mega_backend_summary(self, dtype: torch.dtype) -> str | None:
        """Which fused kernel this layer's decode-sized batches take, and why (startup log)."""
        return self.a2a.kernel_summary(self._rank_experts("mega_backend_summary"), dtype)
