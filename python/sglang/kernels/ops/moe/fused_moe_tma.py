"""One chunk of the fused MoE on the Hopper prefill kernels (``grouped_gemm_tma``).

Same maths and output contract as the two-launch path in ``fused_moe.py``; what differs is the
layout between the GEMMs: the intermediate lives in sorted row order ``[P, I]`` (bf16, or FP8
with its per-128 scales written by the gate-up epilogue), so there is no requantisation pass and
the down GEMM loads its activations through a tensor descriptor.
"""

from __future__ import annotations

import torch

from sglang.kernels.fit.limits import device_limits
from sglang.kernels.ops.moe.align import moe_align_block_size, moe_align_half_tiles
from sglang.kernels.ops.moe.grouped_gemm_tma import (
    TmaMoeConfig,
    launch_down_tma,
    launch_gate_up_tma,
)
from sglang.kernels.ops.moe.sorted_rows import gather_sorted_rows
from sglang.kernels.ops.quant.fp8 import FP8_DTYPE, per_token_group_quant_fp8


def num_sms_of(device: torch.device) -> int:
    """SMs of ``device``; the interpreter (CPU tensors) gets a small grid that still loops."""
    limits = device_limits(device)
    return limits.sm_count if limits is not None else 4


def run_tma_chunk(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    down: torch.Tensor,
    *,
    cfg: TmaMoeConfig,
    scale_block: int,
    act: int,
    limit: float | None,
) -> None:
    """``x`` [n, H] tokens, ``ids``/``weights`` [n, k] -> ``down`` [n*k, H]: each routed row's
    weighted expert output (the caller sums the k rows of a token)."""
    n_tok, top_k = ids.shape
    num_slots = n_tok * top_k
    e, two_i, _ = w13.shape
    inter = two_i // 2
    fp8 = w13.dtype == FP8_DTYPE
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None
    if cfg.half_tiles:  # segments padded to half tiles, and the table of (mixed) row tiles
        sorted_ids, expert_ids, ntpp, table, num_tiles = moe_align_half_tiles(ids, cfg.block_m, e)
        align, tiles = (sorted_ids, expert_ids, ntpp), (table, num_tiles)
    else:
        align = moe_align_block_size(ids, cfg.block_m, e)
    padded = align[0].shape[0]
    sms = num_sms_of(x.device)
    x_scale = None
    if x.stride(1) != 1:
        x = x.contiguous()  # the gate-up kernel gathers rows with unit column stride
    if cfg.sorted_a:  # the rows in sorted order (quantised on the way with FP8)
        group = scale_block if fp8 else None
        x, x_scale = gather_sorted_rows(x, align, top_k=top_k, num_slots=num_slots, group=group)
    elif fp8:
        x, x_scale = per_token_group_quant_fp8(x, scale_block)
    if fp8:
        assert w13_scale is not None and w2_scale is not None
        w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    h_dtype = FP8_DTYPE if fp8 else x.dtype
    h = torch.empty((padded, inter), dtype=h_dtype, device=x.device)
    h_scale = None
    if fp8:
        h_scale = torch.empty((padded, inter // scale_block), dtype=torch.float32, device=x.device)
    launch_gate_up_tma(
        x,
        x_scale,
        w13,
        w13_scale,
        h,
        h_scale,
        align,
        num_slots=num_slots,
        top_k=top_k,
        block_m=cfg.block_m,
        tile=cfg.gemm1,
        scale_block=scale_block,
        act=act,
        limit=limit,
        num_sms=sms,
        a_sorted=cfg.sorted_a,
        tiles=tiles,
    )
    launch_down_tma(
        h,
        h_scale,
        w2,
        w2_scale,
        down,
        weights,
        align,
        num_slots=num_slots,
        block_m=cfg.block_m,
        tile=cfg.gemm2,
        scale_block=scale_block,
        num_sms=sms,
        tiles=tiles,
    )
