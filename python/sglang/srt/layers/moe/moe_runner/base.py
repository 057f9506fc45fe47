"""What every MoE runner is: routed experts on (hidden, top-k) -> combined output [T, H].

Output allocation rule (NCCL symmetric memory): a runner's *final* output — the tensor that
reaches the tensor-parallel all-reduce — is allocated inside :func:`moe_output_scope`, so with
``--enable-symm-mem`` it lives in the registered pool and NCCL takes its symmetric path with no
copy. Intermediates are allocated outside it: the pool never shrinks. A runner that works in place
writes into its input, which the model allocated in the pool (the mHC pre-norm output).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import ClassVar

import torch

from sglang.srt.distributed.symm_mem.output_scope import symmetric_output_scope
from sglang.srt.layers.activation import ACTIVATIONS
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.topk import TopKOutput


@dataclass(frozen=True)
class MoERunConfig:
    activation: str = "swiglu"
    swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"unknown MoE activation {self.activation!r}; expected one of {ACTIVATIONS}"
            )
        if self.swiglu_limit is not None and self.activation != "swiglu":
            raise ValueError(f"swiglu_limit applies to 'swiglu' only, not {self.activation!r}")


def moe_output_scope() -> AbstractContextManager[object]:
    """Allocate the MoE's final output here (the rule is :func:`symmetric_output_scope`'s)."""
    return symmetric_output_scope()


def allocate_moe_output(hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The final output buffer, shaped like ``hidden``: ``out`` when the caller gives one."""
    if out is not None:
        if out.shape != hidden.shape or out.dtype != hidden.dtype:
            raise ValueError(
                f"out {tuple(out.shape)} {out.dtype} must match hidden "
                f"{tuple(hidden.shape)} {hidden.dtype}"
            )
        return out
    with moe_output_scope():
        return torch.empty_like(hidden)


class MoERunner(ABC):
    name: ClassVar[str]
    # CUDA-graph capture needs run() free of host syncs and data-dependent sizes; a runner that
    # is not says why (the decode graphs are then off, with this reason in the startup log).
    capture_safe: ClassVar[bool] = False
    capture_unsafe_reason: ClassVar[str] = "not checked for CUDA-graph capture"

    def __init__(self, config: MoERunConfig) -> None:
        self.config = config

    def run(
        self,
        hidden: torch.Tensor,
        topk: TopKOutput,
        weights: ExpertWeights,
        *,
        inplace: bool = False,
    ) -> torch.Tensor:
        """Combined routed-expert output ``[T, H]`` (top-k weights applied, summed over k).
        With ``inplace`` the result is written into ``hidden`` and ``hidden`` is returned; else
        into a new buffer from :func:`moe_output_scope` (the output rule above)."""
        out = hidden if inplace else allocate_moe_output(hidden)
        return self.run_into(hidden, topk, weights, out)

    @abstractmethod
    def run_into(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights, out: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`run` with its output buffer chosen: write the combined output into ``out``
        (``hidden`` itself when in place) and return ``out``; allocate only intermediates."""

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why this runner cannot run on ``device`` (None: it can)."""
        return None

    def unreadable_reason(self, weights: ExpertWeights) -> str | None:
        """Why :meth:`run` cannot read ``weights`` as they are resident (None: it can). The
        layer then hands it the experts a batch routes to, selected and unpacked on use
        (:func:`~sglang.srt.layers.moe.moe_runner.on_use.run_on_used_experts`). Every runner
        reads bf16 and FP8 128x128 experts in the standard layout."""
        if weights.is_mega:
            return "its experts are in DeepGEMM's MegaMoE layout"
        if weights.is_mxfp4:
            return f"the {self.name} runner has no MXFP4 kernel"
        return None

    def _run_fused(
        self,
        fused_experts: Callable[..., torch.Tensor],
        hidden: torch.Tensor,
        topk: TopKOutput,
        weights: ExpertWeights,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Call a ``fused_experts``-shaped function (kernels/ops/moe/fused_moe.py) into ``out``."""
        return fused_experts(
            hidden,
            weights.w13,
            weights.w2,
            topk.topk_weights,
            topk.topk_ids,
            activation=self.config.activation,
            swiglu_limit=self.config.swiglu_limit,
            w13_scale=weights.w13_scale,
            w2_scale=weights.w2_scale,
            block_shape=weights.block_shape,
            inplace=out is hidden,
            out=out,
        )
