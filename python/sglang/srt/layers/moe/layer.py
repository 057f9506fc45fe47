"""The fused-MoE layer: routed-expert weights, the runner that computes them, the MegaMoE path,
and the tensor-parallel reduction of the result.

Parallel layouts:
- normal path (``moe_a2a_backend="none"``): experts tensor-parallel, each rank holds every expert's
  slice of the intermediate dimension; the partial sums are all-reduced;
- ``moe_a2a_backend="megamoe"``: experts expert-parallel (``E / tp`` whole experts a rank); the
  MegaMoE kernel dispatches and combines over the group itself, so no all-reduce follows. When the
  kernel cannot take a batch, the same local experts run through the runner on ids remapped to
  this rank (others masked with -1) and the partial sums are all-reduced.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import (
    get_tp_group_or_none,
    tensor_model_parallel_all_reduce,
)
from sglang.srt.layers.deep_gemm_adapter import get_deep_gemm
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.mega_moe import MegaMoEParams, choose_mega_backend, try_run_mega_routed
from sglang.srt.layers.moe.moe_runner import MoERunConfig, MoERunner, create_moe_runner
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)

A2ABackend = Literal["none", "megamoe"]


@dataclass(frozen=True)
class FusedMoEConfig:
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    activation: str = "swiglu"
    swiglu_limit: float | None = None
    runner: str = "auto"
    a2a_backend: A2ABackend = "none"
    reduce_results: bool = True


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
        if config.a2a_backend not in ("none", "megamoe"):
            raise ValueError(
                f"unknown MoE a2a backend {config.a2a_backend!r}; expected 'none' or 'megamoe'"
            )
        if config.a2a_backend == "megamoe" and config.num_experts % tp_size:
            raise ValueError(
                f"megamoe places whole experts: {config.num_experts} experts over {tp_size} ranks"
            )
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = torch.device(device)
        name = resolve_runner_name(config.runner, self.device)
        self.runner: MoERunner = create_moe_runner(
            name, MoERunConfig(config.activation, config.swiglu_limit)
        )
        ok, why = self.runner.is_available(self.device)
        if not ok:
            raise ValueError(f"--moe-runner-backend {name} cannot run here: {why}")
        self.weights: ExpertWeights | None = None
        self.mega_weights: Any = None
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

    @property
    def expert_parallel(self) -> bool:
        return self.config.a2a_backend == "megamoe"

    @property
    def local_experts(self) -> range:
        if not self.expert_parallel:
            return range(self.config.num_experts)
        per_rank = self.config.num_experts // self.tp_size
        return range(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)

    @property
    def local_intermediate(self) -> range:
        """The intermediate rows (of gate, and of up) this rank keeps: all of them when expert
        parallel, else its tensor-parallel slice."""
        inter = self.config.intermediate_size
        if self.expert_parallel or self.tp_size == 1:
            return range(inter)
        if inter % self.tp_size:
            raise ValueError(
                f"intermediate size {inter} is not divisible by tp size {self.tp_size}"
            )
        part = inter // self.tp_size
        return range(self.tp_rank * part, (self.tp_rank + 1) * part)

    def load_weights(self, full: ExpertWeights) -> None:
        """Take the full (all experts, unsharded) weights and keep this rank's part."""
        c = self.config
        want = (c.num_experts, 2 * c.intermediate_size, c.hidden_size)
        if tuple(full.w13.shape) != want:
            raise ValueError(f"MoE w13 has shape {tuple(full.w13.shape)}, expected {want}")
        if self.expert_parallel:
            r = self.local_experts
            part = ExpertWeights(
                full.w13[r.start : r.stop],
                full.w2[r.start : r.stop],
                None if full.w13_scale is None else full.w13_scale[r.start : r.stop],
                None if full.w2_scale is None else full.w2_scale[r.start : r.stop],
            )
        else:
            part = full.shard(self.tp_rank, self.tp_size)
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

    def set_mega_weights(self, mega_weights: Any) -> None:
        """DeepGEMM-layout weights ((l1, l1_sf), (l2, l2_sf)) for the MegaMoE kernel."""
        self.mega_weights = mega_weights

    def _local_topk(self, topk: TopKOutput) -> TopKOutput:
        """Remap global expert ids to this rank's experts; the others become -1 (skipped)."""
        r = self.local_experts
        ids = topk.topk_ids
        mine = (ids >= r.start) & (ids < r.stop)
        local = torch.where(mine, ids - r.start, torch.full_like(ids, -1))
        return TopKOutput(torch.where(mine, topk.topk_weights, 0.0), local)

    def forward(
        self, hidden: torch.Tensor, topk: TopKOutput, *, inplace: bool = False
    ) -> torch.Tensor:
        if self.expert_parallel:
            return self.forward_mega(hidden, topk)
        if self.weights is None:
            raise RuntimeError("FusedMoE.forward before load_weights")
        return self._forward_runner(hidden, topk, inplace)

    def forward_mega(self, hidden: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """The MegaMoE path: DeepGEMM's kernel (buffer set-up and pre-dispatch outside the
        reserved-SM context, only the kernel inside it) or our Triton kernel; combined rows over
        the expert-parallel group. Where neither can take the batch, the local experts run through
        the runner on remapped ids and the partial sums are all-reduced."""
        if self.weights is None:
            raise RuntimeError("FusedMoE.forward_mega before load_weights")
        y = try_run_mega_routed(
            get_deep_gemm(),
            get_tp_group_or_none(),
            hidden,
            topk.topk_ids,
            topk.topk_weights,
            self.mega_weights,
            self.mega_params,
            device=self.device if self.device.type == "cuda" else None,
            local_weights=self.weights,
        )
        if y is not None:
            return y
        return self._forward_runner(hidden, self._local_topk(topk), False)

    def mega_backend_summary(self, dtype: torch.dtype) -> str:
        """Which MegaMoE kernel this layer's decode-sized batches take, and why (startup log)."""
        x = torch.empty(1, self.config.hidden_size, dtype=dtype, device=self.device)
        choice = choose_mega_backend(
            get_deep_gemm(),
            get_tp_group_or_none(),
            x,
            self.mega_weights,
            self.mega_params,
            device=self.device if self.device.type == "cuda" else None,
            local_weights=self.weights,
        )
        return choice.describe()

    def _forward_runner(
        self, hidden: torch.Tensor, topk: TopKOutput, inplace: bool
    ) -> torch.Tensor:
        assert self.weights is not None
        out = self.runner.run(hidden, topk, self.weights, inplace=inplace)
        if self.config.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
