"""What every MoE a2a backend is: the placement of experts on this rank, ``dispatch`` (the rows
and routing this rank's runner computes) and ``combine`` (those outputs back to complete rows).

The combine is the one owner of the MoE's tensor-parallel all-reduce: no layer or model block
reduces a MoE output by itself. A layer's forward is route (the model) -> :meth:`dispatch` ->
runner (skipped when the backend's fused kernel already combined the rows) -> :meth:`combine`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from sglang.srt.distributed.parallel_state import tensor_model_parallel_all_reduce
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.fused_moe_config import FusedMoEConfig
from sglang.srt.layers.moe.mega_moe import MegaMoEParams
from sglang.srt.layers.moe.mega_moe_weights import MegaWeights
from sglang.srt.layers.moe.topk import TopKOutput


@dataclass(frozen=True)
class RankExperts:
    """What this rank holds of a layer's experts when it runs."""

    weights: ExpertWeights  # this rank's part, in the runner's layout
    mega_weights: MegaWeights | None  # the same experts in DeepGEMM's MegaMoE layout, if built
    mega_params: MegaMoEParams


@dataclass(frozen=True)
class DispatchOutput:
    """The rows this rank's runner computes and their routing in this rank's expert ids (-1:
    an expert of another rank). ``combined``: the routed output a fused kernel already
    dispatched, computed and combined, so the runner is skipped."""

    hidden: torch.Tensor
    topk: TopKOutput
    combined: torch.Tensor | None = None


def reduce_partial_sums(out: torch.Tensor, tp_size: int) -> torch.Tensor:
    """The one MoE all-reduce: this rank's partial sum -> the sum over the TP group."""
    return tensor_model_parallel_all_reduce(out) if tp_size > 1 else out


class MoEA2ABackend(ABC):
    name: ClassVar[str]
    # True: whole experts a rank (``E / tp`` each, expert parallel); False: every expert's slice
    # of the intermediate dim (tensor parallel).
    places_whole_experts: ClassVar[bool] = False

    def __init__(
        self, config: FusedMoEConfig, *, tp_rank: int, tp_size: int, device: torch.device
    ) -> None:
        if self.places_whole_experts and config.num_experts % tp_size:
            raise ValueError(
                f"{self.name} places whole experts: {config.num_experts} experts over "
                f"{tp_size} ranks"
            )
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = device

    @property
    def local_experts(self) -> range:
        """The global ids of the experts whose weights this rank holds."""
        if not self.places_whole_experts:
            return range(self.config.num_experts)
        per_rank = self.config.num_experts // self.tp_size
        return range(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)

    @property
    def local_intermediate(self) -> range:
        """The intermediate rows (of gate, and of up) this rank keeps: all of them with whole
        experts, else its tensor-parallel slice."""
        inter = self.config.intermediate_size
        if self.places_whole_experts or self.tp_size == 1:
            return range(inter)
        if inter % self.tp_size:
            raise ValueError(
                f"intermediate size {inter} is not divisible by tp size {self.tp_size}"
            )
        part = inter // self.tp_size
        return range(self.tp_rank * part, (self.tp_rank + 1) * part)

    @property
    def shared_expert_tp(self) -> tuple[int, int]:
        """``(tp_rank, tp_size)`` for the model's shared expert: its TP slice when the combine
        reduces partial sums, replicated ``(0, 1)`` with whole experts (no reduce to join)."""
        return (0, 1) if self.places_whole_experts else (self.tp_rank, self.tp_size)

    @abstractmethod
    def dispatch(
        self, hidden: torch.Tensor, topk: TopKOutput, experts: RankExperts
    ) -> DispatchOutput:
        """This rank's rows ``hidden [T, H]`` routed by ``topk`` (global expert ids)."""

    @abstractmethod
    def combine(
        self,
        routed_out: torch.Tensor,
        dispatched: DispatchOutput,
        *,
        shared: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The routed output of ``dispatched`` -> complete ``[T, H]`` rows of this rank, with
        ``shared`` (the shared expert's output, sharded as :attr:`shared_expert_tp` says) added
        where its sharding needs it."""

    def kernel_summary(self, experts: RankExperts, dtype: torch.dtype) -> str | None:
        """Which fused kernel takes decode-sized batches, and why (startup log); None: the
        runner takes every batch."""
        return None
