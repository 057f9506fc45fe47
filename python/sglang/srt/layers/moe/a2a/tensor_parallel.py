"""``--moe-a2a-backend none``: tensor-parallel experts. Every rank holds each expert's slice of
the intermediate dim and runs all routed rows; the partial sums (with the shared expert's
partial sum added in place) are all-reduced once."""

from __future__ import annotations

import torch

from sglang.srt.layers.moe.a2a.base import (
    DispatchOutput,
    MoEA2ABackend,
    reduce_partial_sums,
)
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.topk import TopKOutput


class TensorParallelA2A(MoEA2ABackend):
    name = "none"

    def dispatch(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights
    ) -> DispatchOutput:
        return DispatchOutput(hidden, topk)  # every rank computes every row: nothing moves

    def combine_routed(self, routed_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        return reduce_partial_sums(routed_out, self.tp_size)
