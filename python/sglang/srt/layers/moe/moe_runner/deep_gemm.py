"""The ``deep_gemm`` MoE runner: routed experts through DeepGEMM's grouped GEMMs, bf16 or FP8
(128x128 weight blocks, per-token 128-value activation groups).

Three steps, each in its own function:
1. permute the (token, slot) rows into DeepGEMM's layout (an index, then one gather):
   - contiguous (prefill): rows sorted by expert, each expert's segment padded to DeepGEMM's M
     alignment, ``m_indices[row]`` = expert (-1 on padding). Its size is read back to the host;
   - masked (decode, CUDA graphs): ``[E, max_m, H]`` slabs, ``masked_m[e]`` valid rows, with
     ``max_m`` the token count rounded up to 64, so every shape is fixed by the batch size and
     nothing is read back;
2. ``_run_contiguous_gemm`` / ``_run_bf16_contiguous_gemm`` / ``_run_masked_gemm`` /
   ``_run_masked_bf16_gemm``: gate-up GEMM, activation (and the FP8 requantisation), down GEMM;
3. :func:`post_permute_deep_gemm_to_standard`: top-k weighted sum back to ``[T, H]``, into the
   final output, which alone is allocated in the symmetric-memory scope.

Which layout (or our Triton runner, where it measured faster) runs for a batch is the fastest
measured for the experts' shape and dtype at that size (``path_table.py``: the shape's own
table, else the nearest measured shape at the same rows an expert; ``scripts/tune_moe_paths.py``
writes them), else the token-count rule :data:`LAYOUT_BY_TOKENS` (a dtype never measured), or
forced with ``SGLANG_DEEP_GEMM_MOE_LAYOUT``. Under CUDA-graph capture the contiguous layout is
never chosen (it reads its size back). Experts DeepGEMM cannot take (fp32 or fp16, sizes not
multiples of 128, the family turned off after a build failure: :func:`deep_gemm_unfit_reason`)
run on the Triton fused MoE.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.ops.moe.gather_combine import gather_combine
from sglang.kernels.ops.quant.fp8 import per_token_group_quant_fp8
from sglang.srt.environ import envs
from sglang.srt.layers.activation import act_and_mul
from sglang.srt.layers.deep_gemm_adapter import (
    deep_gemm_call_guard,
    deep_gemm_status,
    get_deep_gemm,
    resolve_entry_point,
)
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner.base import MoERunConfig, MoERunner
from sglang.srt.layers.moe.moe_runner.path_table import (
    MoeShape,
    fastest_path,
    log_choice,
    shape_of,
)
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)

Layout = Literal["contiguous", "masked", "triton"]
LayoutChoice = Literal["auto", "contiguous", "masked", "triton"]

# (largest token count, layout) per expert dtype, first match wins; beyond the last, contiguous.
# Measured on one H200 at the DSv4 and K3 expert shapes (docs/performance.md, bench_moe.py):
# Triton beats the masked layout at every M up to 512 (masked is 0.20-0.84x: its [E, max_m]
# slabs are mostly padding on one GPU) and the contiguous one up to 512 (0.62-0.71x); from 2048
# contiguous wins: FP8 1.18x (DSv4) and 1.55x (K3), bf16 1.01-1.07x; at 8192 1.28-2.16x.
LAYOUT_BY_TOKENS: dict[str, tuple[tuple[int, Layout], ...]] = {
    "bf16": ((1024, "triton"),),
    "fp8": ((1024, "triton"),),
}
_FP8_GROUP = 128
# DeepGEMM's masked GEMMs read wrong rows when the slab height is not a multiple of this
# (measured on the H200 with 0.1.5.post1: max_m 1, 7, 16 wrong, 64 and 512 right).
MASKED_M_ALIGN = 64


@dataclass(frozen=True)
class ContiguousLayout:
    src: torch.Tensor  # [R] int64: the token each row is read from (padding: token 0, unread)
    m_indices: torch.Tensor  # [R] int32, -1 on padding
    row_of: torch.Tensor  # [T, k] int64: each (token, slot)'s row (-1: unrouted)


@dataclass(frozen=True)
class MaskedLayout:
    src: torch.Tensor  # [E * max_m] int64: the token of each slab row (past masked_m: token 0)
    masked_m: torch.Tensor  # [E] int32
    max_m: int
    expected_m: int  # DeepGEMM's tiling hint: the mean rows per expert
    row_of: torch.Tensor  # [T, k] int64 into the slabs viewed as rows (-1: unrouted)


def choose_layout(num_tokens: int, fp8: bool, capturing: bool) -> Layout:
    """The layout for a batch of ``num_tokens``: from :data:`LAYOUT_BY_TOKENS`; never contiguous
    while a CUDA graph is captured (its size is read back to the host): Triton then, which
    measured faster than the masked layout at every size."""
    layout: Layout = "contiguous"
    for max_tokens, choice in LAYOUT_BY_TOKENS["fp8" if fp8 else "bf16"]:
        if num_tokens <= max_tokens:
            layout = choice
            break
    if capturing and layout == "contiguous":
        return "triton"
    return layout


_LAYOUT_OF_PATH: dict[str, Layout] = {
    "triton": "triton",
    "deep_gemm_contiguous": "contiguous",
    "deep_gemm_masked": "masked",
}


def measured_layout(
    shape: MoeShape, fp8: bool, num_tokens: int, capturing: bool, device: str | None = None
) -> Layout | None:
    """The fastest measured of Triton and the two DeepGEMM layouts for this shape at this size
    (its table or the nearest measured shape's; contiguous not under capture) on ``device``'s
    tables (default: this process's GPU, else the H200's), logged once per choice; None where
    nothing of this dtype was measured."""
    candidates = [p for p in _LAYOUT_OF_PATH if not (capturing and p == "deep_gemm_contiguous")]
    dtype = "fp8" if fp8 else "bf16"
    picked = fastest_path(shape, dtype, num_tokens, candidates, device)
    if picked is None:
        return None
    log_choice(f"deep_gemm runner {dtype} E={shape.experts} H={shape.hidden}", picked[1])
    return _LAYOUT_OF_PATH[picked[0]]


# --- 1. permute ----------------------------------------------------------------------------------
# Each layout is an index: which token every row reads. The rows are then gathered in one pass
# (index_select), after the T token rows were quantised once for FP8: a scatter of the T*k
# routed rows, a zero fill and quantising k times as many rows were the largest non-GEMM costs
# of a prefill MoE (docs/performance.md, "The DeepGEMM runner").


def _expert_ranks(
    flat_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For flat expert ids (-1 = unrouted): (key: id, or ``num_experts`` for unrouted; the rank
    of each entry among its expert's entries, in (token, slot) order; per-key counts
    ``[num_experts + 1]``). Fixed shapes, no host read."""
    valid = flat_ids >= 0
    key = torch.where(valid, flat_ids, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    order = torch.argsort(key, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(key.numel(), device=key.device) - starts[key[order]]
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return key, rank, counts


def _sources(dest: torch.Tensor, valid: torch.Tensor, rows: int, top_k: int) -> torch.Tensor:
    """``src[row]`` = the token routed to ``row`` (0 where none is); ``dest`` per flat entry."""
    src = torch.zeros(rows + 1, dtype=torch.int64, device=dest.device)  # the last row: a dump
    token = torch.arange(dest.numel(), device=dest.device) // top_k
    src[torch.where(valid, dest, rows)] = token
    return src[:rows]


def permute_contiguous(topk_ids: torch.Tensor, num_experts: int, align: int) -> ContiguousLayout:
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    key, rank, counts = _expert_ranks(flat, num_experts)
    padded = (counts[:num_experts] + align - 1) // align * align
    starts = torch.cumsum(padded, 0) - padded
    total = max(int(padded.sum()), align)  # the one host read: the layout's size
    valid = key < num_experts
    dest = torch.where(valid, starts[key.clamp_max(num_experts - 1)] + rank, -1)
    m_indices = torch.full((total + 1,), -1, dtype=torch.int32, device=topk_ids.device)
    m_indices[torch.where(valid, dest, total)] = torch.where(valid, key, -1).int()
    return ContiguousLayout(_sources(dest, valid, total, k), m_indices[:total], dest.view(t, k))


def permute_masked(topk_ids: torch.Tensor, num_experts: int) -> MaskedLayout:
    t, k = topk_ids.shape
    # A token picks an expert at most once, so t rows a slab suffice; rounded up for DeepGEMM.
    max_m = max(1, -(-t // MASKED_M_ALIGN)) * MASKED_M_ALIGN
    flat = topk_ids.reshape(-1).long()
    key, rank, counts = _expert_ranks(flat, num_experts)
    valid = key < num_experts
    row_of = torch.where(valid, key * max_m + rank, -1)
    src = _sources(row_of, valid, num_experts * max_m, k)
    expected_m = max(1, (t * k + num_experts - 1) // num_experts)
    return MaskedLayout(src, counts[:num_experts].int(), max_m, expected_m, row_of.view(t, k))


def _gather(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float8_e4m3fn:  # index_select has no FP8 kernel: move the bytes
        return torch.index_select(x.view(torch.uint8), 0, src).view(x.dtype)
    return torch.index_select(x, 0, src)


def gather_rows(hidden: torch.Tensor, src: torch.Tensor, fp8: bool) -> Any:
    """The layout's input rows: bf16 rows, or (FP8 rows, their per-128 scales) from the tokens
    quantised once."""
    if not fp8:
        return _gather(hidden, src)
    q, scale = per_token_group_quant_fp8(hidden, _FP8_GROUP)
    return _gather(q, src), _gather(scale, src)


# --- 2. the grouped GEMMs ------------------------------------------------------------------------


def _quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 128-value FP8 groups of ``x [..., K]``, shaped like ``x``."""
    lead = x.shape[:-1]
    q, s = per_token_group_quant_fp8(x.reshape(-1, x.shape[-1]), _FP8_GROUP)
    return q.view(*lead, -1), s.view(*lead, -1)


def _act(gate_up: torch.Tensor, config: MoERunConfig) -> torch.Tensor:
    return act_and_mul(gate_up, config.activation, swiglu_limit=config.swiglu_limit)  # type: ignore[arg-type]


def _reshape(a: Any, lead: tuple[int, ...]) -> Any:
    if isinstance(a, tuple):
        return tuple(t.view(*lead, t.shape[-1]) for t in a)
    return a.view(*lead, a.shape[-1])


def _two_gemms(
    gemm: Callable[..., Any],
    a: Any,
    lead: tuple[int, ...],
    w: ExpertWeights,
    config: MoERunConfig,
    *layout: Any,
) -> torch.Tensor:
    """gate-up GEMM on the input rows ``a`` (bf16, or (FP8, scales)) -> activation (-> FP8
    groups) -> down GEMM, both through ``gemm``; rows shaped ``lead``."""
    fp8 = isinstance(a, tuple)
    device = w.w13.device
    gate_up = torch.empty(*lead, 2 * w.intermediate_size, dtype=torch.bfloat16, device=device)
    down = torch.empty(*lead, w.hidden_size, dtype=torch.bfloat16, device=device)
    a = _reshape(a, lead)
    with deep_gemm_call_guard():
        if fp8:
            gemm(a, (w.w13, w.w13_scale), gate_up, *layout)
            gemm(_quant(_act(gate_up, config)), (w.w2, w.w2_scale), down, *layout)
        else:
            gemm(a, w.w13, gate_up, *layout)
            gemm(_act(gate_up, config), w.w2, down, *layout)
    return down


def _run_contiguous_gemm(
    dg: Any, a: Any, layout: ContiguousLayout, w: ExpertWeights, config: MoERunConfig
) -> torch.Tensor:
    """FP8 experts, contiguous layout: rows ``a = (FP8 [R, H], scales)`` -> down rows ``[R, H]``."""
    gemm = resolve_entry_point(dg, "fp8_contiguous")
    return _two_gemms(gemm, a, (layout.src.numel(),), w, config, layout.m_indices)


def _run_bf16_contiguous_gemm(
    dg: Any, a: torch.Tensor, layout: ContiguousLayout, w: ExpertWeights, config: MoERunConfig
) -> torch.Tensor:
    """bf16 experts, contiguous layout: ``[R, H]`` rows -> ``[R, H]``."""
    gemm = resolve_entry_point(dg, "bf16_contiguous")
    return _two_gemms(gemm, a, (layout.src.numel(),), w, config, layout.m_indices)


def _run_masked_gemm(
    dg: Any, a: Any, layout: MaskedLayout, w: ExpertWeights, config: MoERunConfig
) -> torch.Tensor:
    """FP8 experts, masked layout: ``(FP8, scales)`` slab rows -> ``[E, max_m, H]``."""
    gemm = resolve_entry_point(dg, "fp8_masked")
    lead = (layout.masked_m.numel(), layout.max_m)
    return _two_gemms(gemm, a, lead, w, config, layout.masked_m, layout.expected_m)


def _run_masked_bf16_gemm(
    dg: Any, a: torch.Tensor, layout: MaskedLayout, w: ExpertWeights, config: MoERunConfig
) -> torch.Tensor:
    """bf16 experts, masked layout: slab rows -> ``[E, max_m, H]``."""
    gemm = resolve_entry_point(dg, "bf16_masked")
    lead = (layout.masked_m.numel(), layout.max_m)
    return _two_gemms(gemm, a, lead, w, config, layout.masked_m, layout.expected_m)


# --- 3. back to [T, H] ---------------------------------------------------------------------------


def post_permute_deep_gemm_to_standard(
    down: torch.Tensor, row_of: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """DeepGEMM-layout down rows (``[R, H]`` or ``[E, max_m, H]``) -> ``out [T, H]``: each token's
    rows weighted by its top-k weights and summed (fp32 accumulation)."""
    return gather_combine(down.reshape(-1, down.shape[-1]), row_of, topk_weights, out)


# The grouped GEMMs tile K and N by 128 (the FP8 scale block; bf16 takes the same tiles).
DEEP_GEMM_DIM_ALIGN = 128


def deep_gemm_unfit_reason(weights: ExpertWeights) -> str | None:
    """None when DeepGEMM's grouped GEMMs take these experts (bf16, or FP8 in 128x128 blocks;
    hidden and intermediate sizes multiples of 128; the family on), else why the Triton fused
    MoE runs the batch instead."""
    off = unfit_reason("deep_gemm")
    if off is not None:
        return off
    dtype = weights.w13.dtype
    if dtype == torch.float8_e4m3fn:
        if tuple(weights.block_shape or (128, 128)) != (128, 128):
            return f"FP8 experts in {weights.block_shape} blocks (DeepGEMM takes 128x128)"
    elif dtype != torch.bfloat16:
        return f"experts of {dtype} (DeepGEMM's grouped GEMMs take bf16 or FP8)"
    h, i = weights.hidden_size, weights.intermediate_size
    if h % DEEP_GEMM_DIM_ALIGN or i % DEEP_GEMM_DIM_ALIGN:
        return f"hidden {h} / intermediate {i} are not multiples of {DEEP_GEMM_DIM_ALIGN}"
    return None


class DeepGemmMoERunner(MoERunner):
    name = "deep_gemm"
    # Under capture only the masked layout or the Triton runner runs: fixed shapes, no host read.
    capture_safe = True

    def __init__(
        self, config: MoERunConfig, deep_gemm: Any = None, *, layout: LayoutChoice | None = None
    ) -> None:
        """``layout`` None: ``SGLANG_DEEP_GEMM_MOE_LAYOUT``."""
        super().__init__(config)
        self._dg = deep_gemm
        self.layout: LayoutChoice = layout or envs.SGLANG_DEEP_GEMM_MOE_LAYOUT.get()  # type: ignore[assignment]

    @property
    def dg(self) -> Any:
        dg = self._dg or get_deep_gemm()
        if dg is None:
            raise RuntimeError(
                f"the deep_gemm MoE runner needs DeepGEMM: {deep_gemm_status().reason}"
            )
        return dg

    def unavailable_reason(self, device: torch.device) -> str | None:
        if self._dg is not None:
            return None
        status = deep_gemm_status()
        return None if status.usable else status.reason

    def layout_for(self, num_tokens: int, fp8: bool, shape: MoeShape | None = None) -> Layout:
        """The forced layout, else the fastest measured one for ``shape`` (``path_table``), else
        :func:`choose_layout`'s token-count rule."""
        if self.layout != "auto":
            return self.layout
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if shape is not None:
            measured = measured_layout(shape, fp8, num_tokens, capturing)
            if measured is not None:
                return measured
        return choose_layout(num_tokens, fp8, capturing)

    def run_into(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights, out: torch.Tensor
    ) -> torch.Tensor:
        fp8 = weights.w13.dtype == torch.float8_e4m3fn
        unfit = deep_gemm_unfit_reason(weights)
        if unfit is not None:
            log_once(logger, logging.INFO, f"deep_gemm MoE runner: Triton fused MoE ({unfit})")
            layout: Layout = "triton"  # the Triton fused MoE takes every dtype and shape
        else:
            shape = shape_of(weights, topk.topk_ids.shape[1])
            layout = self.layout_for(hidden.shape[0], fp8, shape)
        if layout == "triton":
            from sglang.kernels.ops.moe.fused_moe import fused_experts

            return self._run_fused(fused_experts, hidden, topk, weights, out)
        x = hidden if hidden.dtype == torch.bfloat16 else hidden.to(torch.bfloat16)
        e = weights.num_experts
        if layout == "contiguous":
            align = int(resolve_entry_point(self.dg, "contiguous_alignment")())
            cl = permute_contiguous(topk.topk_ids, e, align)
            run = _run_contiguous_gemm if fp8 else _run_bf16_contiguous_gemm
            down, row_of = (
                run(self.dg, gather_rows(x, cl.src, fp8), cl, weights, self.config),
                cl.row_of,
            )
        else:
            ml = permute_masked(topk.topk_ids, e)
            run_m = _run_masked_gemm if fp8 else _run_masked_bf16_gemm
            down, row_of = (
                run_m(self.dg, gather_rows(x, ml.src, fp8), ml, weights, self.config),
                ml.row_of,
            )
        return post_permute_deep_gemm_to_standard(down, row_of, topk.topk_weights, out)
