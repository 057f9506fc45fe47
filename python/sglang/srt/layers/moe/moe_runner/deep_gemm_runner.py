"""Grouped GEMMs through DeepGEMM, where it loads: contiguous layout for prefill-sized batches,
masked layout for decode-sized ones. bf16 and FP8 (128x128 weight blocks, per-128 activations).

Contiguous: the (token, slot) rows are sorted by expert and each expert's segment padded to
DeepGEMM's M alignment; ``m_indices`` names each row's expert (-1 on padding).
Masked: rows are scattered into ``[E, max_m, H]`` with ``masked_m[e]`` valid rows per expert.
Either way the down-projection rows are weighted by their top-k weight and summed per token into
the final output, which alone is allocated in the symmetric-memory scope.
"""

from __future__ import annotations

from types import ModuleType

import torch

from sglang.kernels.ops.quant.fp8 import per_token_group_quant_fp8
from sglang.srt.layers.activation import act_and_mul
from sglang.srt.layers.deep_gemm_adapter import (
    deep_gemm_call_guard,
    deep_gemm_status,
    get_deep_gemm,
)
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner.base import MoERunner, allocate_moe_output
from sglang.srt.layers.moe.topk import TopKOutput

# Below this many routed rows per expert on average, the masked layout wastes less than padding.
MASKED_MAX_TOKENS = 64


class DeepGemmMoERunner(MoERunner):
    name = "deep_gemm"
    capture_unsafe_reason = (
        "the deep_gemm MoE runner sizes its grouped-GEMM layout from routed counts read back to "
        "the host"
    )

    def __init__(self, config, deep_gemm: ModuleType | None = None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config)
        self._dg = deep_gemm

    @property
    def dg(self) -> ModuleType:
        dg = self._dg or get_deep_gemm()
        if dg is None:
            raise RuntimeError(f"the deep_gemm MoE runner needs DeepGEMM: {deep_gemm_status().reason}")
        return dg

    def is_available(self, device: torch.device) -> tuple[bool, str]:
        if self._dg is not None:
            return True, ""
        status = deep_gemm_status()
        return status.usable, status.reason

    def run(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights, *, inplace: bool = False
    ) -> torch.Tensor:
        if hidden.shape[0] <= MASKED_MAX_TOKENS:
            routed = self._masked(hidden, topk, weights)
        else:
            routed = self._contiguous(hidden, topk, weights)
        # routed: [T, k, H] fp32 with top-k weights applied; only the sum is the final output.
        out = hidden if inplace else allocate_moe_output(hidden)
        out.copy_(routed.sum(dim=1))
        return out

    # --- GEMM helpers -------------------------------------------------------------------------

    def _gemm(self, kind: str, a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
              out: torch.Tensor, *layout: torch.Tensor | int) -> None:
        dg = self.dg
        with deep_gemm_call_guard():
            if w_scale is None:
                getattr(dg, f"m_grouped_bf16_gemm_nt_{kind}")(a, w, out, *layout)
            else:
                lead = a.shape[:-1]
                q, s = per_token_group_quant_fp8(a.reshape(-1, a.shape[-1]), 128)
                getattr(dg, f"m_grouped_fp8_gemm_nt_{kind}")(
                    (q.view(*lead, -1), s.view(*lead, -1)), (w, w_scale), out, *layout
                )

    def _experts(self, rows: torch.Tensor, weights: ExpertWeights, kind: str,
                 *layout: torch.Tensor | int) -> torch.Tensor:
        inter = weights.intermediate_size
        gate_up = rows.new_empty(*rows.shape[:-1], 2 * inter)
        self._gemm(kind, rows, weights.w13, weights.w13_scale, gate_up, *layout)
        act = act_and_mul(gate_up, self.config.activation, swiglu_limit=self.config.swiglu_limit)
        down = rows.new_empty(*rows.shape[:-1], weights.hidden_size)
        self._gemm(kind, act, weights.w2, weights.w2_scale, down, *layout)
        return down

    def _contiguous(self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights) -> torch.Tensor:
        t, k = topk.topk_ids.shape
        align = int(self.dg.get_mk_alignment_for_contiguous_layout())
        flat_ids = topk.topk_ids.reshape(-1).long()
        valid = flat_ids >= 0
        counts = torch.bincount(flat_ids[valid], minlength=weights.num_experts)
        padded = (counts + align - 1) // align * align
        starts = torch.cumsum(padded, 0) - padded
        order = torch.argsort(torch.where(valid, flat_ids, weights.num_experts), stable=True)
        sorted_ids = flat_ids[order]
        n_valid = int(valid.sum())
        rank_in_expert = torch.arange(n_valid, device=hidden.device) - (torch.cumsum(counts, 0) - counts)[sorted_ids[:n_valid]]
        dest = starts[sorted_ids[:n_valid]] + rank_in_expert
        total = max(int(padded.sum()), align)
        m_indices = torch.full((total,), -1, dtype=torch.int32, device=hidden.device)
        m_indices[dest] = sorted_ids[:n_valid].int()
        rows = hidden.new_zeros(total, hidden.shape[1])
        rows[dest] = hidden[order[:n_valid] // k]
        down = self._experts(rows, weights, "contiguous", m_indices)
        routed = torch.zeros(t * k, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        routed[order[:n_valid]] = down[dest].float()
        return routed.view(t, k, -1) * topk.topk_weights.unsqueeze(-1)

    def _masked(self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights) -> torch.Tensor:
        t, k = topk.topk_ids.shape
        e = weights.num_experts
        flat_ids = topk.topk_ids.reshape(-1).long()
        valid = (flat_ids >= 0).nonzero().squeeze(1)
        ids = flat_ids[valid]
        counts = torch.bincount(ids, minlength=e)
        max_m = max(int(counts.max()) if ids.numel() else 1, 1)
        order = torch.argsort(ids, stable=True)
        slot = torch.arange(ids.numel(), device=hidden.device) - (torch.cumsum(counts, 0) - counts)[ids[order]]
        rows = hidden.new_zeros(e, max_m, hidden.shape[1])
        rows[ids[order], slot] = hidden[valid[order] // k]
        expected_m = max(1, (t * k + e - 1) // e)
        down = self._experts(rows, weights, "masked", counts.int(), expected_m)
        routed = torch.zeros(t * k, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        routed[valid[order]] = down[ids[order], slot].float()
        return routed.view(t, k, -1) * topk.topk_weights.unsqueeze(-1)
