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
from sglang.srt.layers.moe.expert_plan import MegaKernelChoice
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.fused_moe_config import FusedMoEConfig
from sglang.srt.layers.moe.mega_moe_weights import MegaWeights
from sglang.srt.layers.moe.topk import TopKOutput


@dataclass(frozen=True)
class DispatchOutput:
    """The rows this rank's runner computes and their routing in this rank's expert ids (-1:
    an expert of another rank). ``combined``: the routed output a fused kernel already
    dispatched, computed and combined, so the runner is skipped. ``runner_inplace``: ``hidden``
    is the backend's own rank-local buffer, which the runner overwrites with its output (no
    output allocation, so nothing of a rank-dependent size reaches the symmetric pool).
    ``handle``: what the backend's combine needs of this dispatch (its own type)."""

    hidden: torch.Tensor
    topk: TopKOutput
    combined: torch.Tensor | None = None
    runner_inplace: bool = False
    handle: object | None = None


def reduce_partial_sums(out: torch.Tensor, tp_size: int) -> torch.Tensor:
    """The one MoE all-reduce: this rank's partial sum -> the sum over the TP group."""
    return tensor_model_parallel_all_reduce(out) if tp_size > 1 else out


class MoEA2ABackend(ABC):
    """Where one layer's experts sit on this rank, for ``ep_size`` expert-parallel ranks in a TP
    group of ``tp_size``: TP rank ``r`` is EP rank ``r // moe_tp_size`` (which experts:
    ``num_experts / ep_size`` of them) and MoE-TP rank ``r % moe_tp_size`` (which slice of each
    expert's intermediate dim), ``moe_tp_size = tp_size / ep_size``. Tensor parallel is
    ``ep_size == 1``; whole experts a rank is ``ep_size == tp_size``."""

    name: ClassVar[str]
    # True: expert parallel (``ep_size`` defaults to the TP size; the combine returns complete
    # rows and the shared expert is replicated); False: tensor parallel (``ep_size`` is 1).
    expert_parallel: ClassVar[bool] = False
    # Why this backend cannot split the experts over part of the group with TP-sliced experts
    # inside it (``ep_size < tp_size``); None: it can.
    partial_ep_unsupported: ClassVar[str | None] = "it places whole experts on each rank"
    # True: the loader builds DeepGEMM MegaMoE weights for this backend's fused kernel.
    uses_mega_weights: ClassVar[bool] = False
    # Why a decode step through this backend cannot be captured in a CUDA graph (None: it can).
    capture_unsafe_reason: ClassVar[str | None] = None

    def __init__(
        self, config: FusedMoEConfig, *, tp_rank: int, tp_size: int, device: torch.device
    ) -> None:
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = device
        default = tp_size if self.expert_parallel else 1
        self.ep_size = config.ep_size if config.ep_size is not None else default
        why = self._placement_error()
        if why is not None:
            raise ValueError(f"--moe-a2a-backend {self.name} {why}")
        self.moe_tp_size = tp_size // self.ep_size
        self.ep_rank, self.moe_tp_rank = divmod(tp_rank, self.moe_tp_size)

    def _placement_error(self) -> str | None:
        e, t, n = self.ep_size, self.tp_size, self.config.num_experts
        if not self.expert_parallel:
            return None if e == 1 else f"is tensor parallel: its ep size must be 1, got {e}"
        if e < 1 or t % e:
            return f"needs --ep-size ({e}) to divide --tp-size ({t})"
        if e < t and self.partial_ep_unsupported is not None:
            return (
                f"needs --ep-size equal to --tp-size {t} (or 1), got {e}: "
                f"{self.partial_ep_unsupported}"
            )
        inter = self.config.intermediate_size
        if inter % (t // e):
            return (
                f"slices each expert over tp_size / ep_size = {t // e} ranks: intermediate size "
                f"{inter} is not divisible by {t // e}"
            )
        if n % e:
            what = "whole experts" if e == t else "num_experts / ep_size experts"
            return (
                f"places {what} on each rank: {n} experts do not divide over {e} ranks "
                "(--ep-size / --tp-size)"
            )
        return None

    @property
    def local_experts(self) -> range:
        """The global ids of the experts whose weights this rank holds."""
        per_rank = self.config.num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    @property
    def local_intermediate(self) -> range:
        """The intermediate rows (of gate, and of up) this rank keeps of each of its experts:
        its slice over the ``moe_tp_size`` ranks that share them (all rows for whole experts)."""
        inter, m = self.config.intermediate_size, self.moe_tp_size
        if m == 1:
            return range(inter)
        if inter % m:
            raise ValueError(
                f"intermediate size {inter} is not divisible by the {m} ranks that slice each "
                f"expert (tp size {self.tp_size} / ep size {self.ep_size})"
            )
        part = inter // m
        return range(self.moe_tp_rank * part, (self.moe_tp_rank + 1) * part)

    @property
    def shared_expert_tp(self) -> tuple[int, int]:
        """``(tp_rank, tp_size)`` for the model's shared expert: its TP slice when the combine
        reduces partial sums over the TP group, replicated ``(0, 1)`` under expert parallelism
        (no TP-wide reduce to join)."""
        return (0, 1) if self.expert_parallel else (self.tp_rank, self.tp_size)

    @abstractmethod
    def dispatch(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights
    ) -> DispatchOutput:
        """This rank's rows ``hidden [T, H]`` routed by ``topk`` (global expert ids), for the
        experts this rank holds (``weights``, in the runner's layout)."""

    def combine(
        self,
        routed_out: torch.Tensor,
        dispatched: DispatchOutput,
        *,
        shared: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The routed output of ``dispatched`` -> complete ``[T, H]`` rows of this rank, with
        ``shared`` (the shared expert's output, sharded as :attr:`shared_expert_tp` says) added
        where its sharding needs it: a TP partial sum joins the routed partial sum before the
        one reduce; replicated rows join the complete rows."""
        if self.expert_parallel:
            out = self.combine_routed(routed_out, dispatched)
            return out if shared is None else out + shared
        if shared is not None:
            # In place: ``routed_out`` is the runner's final output, allocated in the symmetric
            # pool when --enable-symm-mem is on; ``routed_out + shared`` would hand NCCL a
            # non-pool tensor.
            routed_out += shared
        return self.combine_routed(routed_out, dispatched)

    @abstractmethod
    def combine_routed(self, routed_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        """The routed output of ``dispatched`` (with a tensor-parallel shared expert's partial
        sum already added) -> complete ``[T, H]`` rows of this rank."""

    def mega_weights(self, weights: ExpertWeights | None) -> MegaWeights | None:
        """The DeepGEMM MegaMoE-layout weights this backend's fused kernel reads (None: it runs
        none)."""
        return None

    def set_mega_weights(self, mega_weights: MegaWeights | None) -> None:
        raise ValueError(
            f"--moe-a2a-backend {self.name} runs no MegaMoE kernel: it takes no MegaMoE weights"
        )

    def mega_kernel_for(
        self, hidden: torch.Tensor, weights: ExpertWeights
    ) -> MegaKernelChoice | None:
        """The MegaMoE kernel that takes ``hidden``'s batch (the models then call their MegaMoE
        call site with it), or None: the experts' normal call takes the batch."""
        return None

    def run_mega_moe(
        self,
        hidden: torch.Tensor,
        topk: TopKOutput,
        weights: ExpertWeights,
        kernel: MegaKernelChoice,
    ) -> torch.Tensor:
        """The MegaMoE ``kernel`` (:meth:`mega_kernel_for`'s choice) alone on these rows,
        combined over the group; raises naming why when this backend runs none."""
        raise RuntimeError(f"--moe-a2a-backend {self.name} runs no MegaMoE kernel")

    def kernel_summary(self, weights: ExpertWeights, dtype: torch.dtype) -> str | None:
        """Which fused kernel takes decode-sized batches, and why (startup log); None: the
        runner takes every batch."""
        return None
