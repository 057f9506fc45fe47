"""``--moe-a2a-backend megamoe``: expert-parallel experts (``E / tp`` whole experts a rank).
The MegaMoE kernel (DeepGEMM's, or our Triton one on one GPU; :mod:`..mega_moe`) dispatches,
computes and combines over the group itself, so nothing is reduced. When no kernel can take a
batch, the runner computes this rank's experts on ids remapped to them (the others -1) and the
partial sums are all-reduced. The shared expert is replicated and added after the combine."""

from __future__ import annotations

import torch

from sglang.srt.distributed.parallel_state import get_tp_group_or_none
from sglang.srt.layers.deep_gemm_adapter import get_deep_gemm
from sglang.srt.layers.moe.a2a.base import (
    DispatchOutput,
    MoEA2ABackend,
    RankExperts,
    reduce_partial_sums,
)
from sglang.srt.layers.moe.mega_moe import choose_mega_backend, try_run_mega_routed
from sglang.srt.layers.moe.topk import TopKOutput


class MegaMoEA2A(MoEA2ABackend):
    name = "megamoe"
    expert_parallel = True
    partial_ep_unsupported = (
        "the MegaMoE kernel dispatches, computes and combines whole experts over the whole TP "
        "group in one fused call, with no reduce of TP-sliced experts' partial sums over part "
        "of the group; use --moe-a2a-backend ep for --ep-size < --tp-size"
    )
    uses_mega_weights = True

    @property
    def _kernel_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def dispatch(
        self, hidden: torch.Tensor, topk: TopKOutput, experts: RankExperts
    ) -> DispatchOutput:
        """DeepGEMM's kernel (buffer set-up and pre-dispatch outside the reserved-SM context,
        only the kernel inside it) or our Triton kernel; else the runner's rows."""
        combined = try_run_mega_routed(
            get_deep_gemm(),
            get_tp_group_or_none(),
            hidden,
            topk.topk_ids,
            topk.topk_weights,
            experts.mega_weights,
            experts.mega_params,
            device=self._kernel_device,
            local_weights=experts.weights,
        )
        if combined is not None:
            return DispatchOutput(hidden, topk, combined)
        return DispatchOutput(hidden, self._local_topk(topk))

    def _local_topk(self, topk: TopKOutput) -> TopKOutput:
        """Remap global expert ids to this rank's experts; the others become -1 (skipped)."""
        r = self.local_experts
        ids = topk.topk_ids
        mine = (ids >= r.start) & (ids < r.stop)
        local = torch.where(mine, ids - r.start, torch.full_like(ids, -1))
        return TopKOutput(torch.where(mine, topk.topk_weights, 0.0), local)

    def combine(
        self,
        routed_out: torch.Tensor,
        dispatched: DispatchOutput,
        *,
        shared: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = routed_out
        if dispatched.combined is None:  # the runner's partial sum over this rank's experts
            out = reduce_partial_sums(routed_out, self.tp_size)
        return out if shared is None else out + shared

    def kernel_summary(self, experts: RankExperts, dtype: torch.dtype) -> str | None:
        x = torch.empty(1, self.config.hidden_size, dtype=dtype, device=self.device)
        choice = choose_mega_backend(
            get_deep_gemm(),
            get_tp_group_or_none(),
            x,
            experts.mega_weights,
            experts.mega_params,
            device=self._kernel_device,
            local_weights=experts.weights,
        )
        return choice.describe()
