"""Fused MoE experts with Triton: two grouped GEMMs over expert-sorted rows, then a combine.

Pipeline for ``T`` tokens routed to ``k`` experts each (``S = T*k`` routed rows):

1. ``moe_align_any_order`` groups the rows by expert in tiles of ``block_m`` (one token: each
   slot gets a tile of its own).
2. GEMM 1 (``_moe_gemm1_kernel``): for each tile of rows of one expert and a column block ``n``,
   accumulate gate (``w13[e, n]``) and up (``w13[e, I + n]``) side by side and apply the gated
   activation in the epilogue, so ``gate_up`` [S, 2I] never reaches memory. Writes ``inter`` [S, I].
3. GEMM 2 (``_moe_gemm2_kernel``): ``inter @ w2[e].T`` times the row's top-k weight -> [S, H].
4. Combine (``_moe_sum_kernel``): sum each token's k rows in fp32 into the output; slots with an
   id outside ``[0, E)`` (masked, -1) contribute nothing.

Weights are bf16 or FP8 e4m3 with one fp32 scale per ``block_shape`` (128 x 128) tile; with FP8
the activations entering each GEMM are quantised per token per group of ``block_shape[1]`` values
(``per_token_group_quant_fp8``), and the GEMMs apply both scales per K block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import limits_for, note_fallback, unfit_reason
from sglang.kernels.fit.footprint import element_bytes
from sglang.kernels.ops.activation import act_and_mul_reference, activation_code, gated_act
from sglang.kernels.ops.moe.align import moe_align_any_order
from sglang.kernels.ops.moe.fused_moe_tma import run_tma_chunk
from sglang.kernels.ops.moe.grouped_gemm_tma import TmaMoeConfig, tma_config_fits
from sglang.kernels.ops.moe.tuned_configs import fit_two_launch, select_moe_config
from sglang.kernels.ops.moe.two_launch_config import FusedMoeConfig, GemmTile, get_config
from sglang.kernels.ops.quant.fp8 import FP8_DTYPE, block_dequant_fp8, per_token_group_quant_fp8
from sglang.kernels.ops.tile_order import grouped_tile
from sglang.kernels.ops.triton_dispatch import triton_can_run

if TYPE_CHECKING:
    from triton.runtime.jit import JITFunction

# Bounds the intermediate caches ([chunk*k, I] and [chunk*k, H]) for very long prefills.
CHUNK_TOKENS = 16 * 1024
DEFAULT_FP8_BLOCK = (128, 128)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(num_m_blocks, n_cols, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # This program's (row tile, column tile), one program a tile, in the grouped order.
    return grouped_tile(tl.program_id(0), num_m_blocks, tl.cdiv(n_cols, BLOCK_N), GROUP_M)


# What both GEMMs do alike. @triton.jit helpers are inlined, so the kernels do exactly the work
# they did when these lines were written out in each.


@triton.jit
def _tile_rows(pid_m, sorted_ids_ptr, num_slots, BLOCK_M: tl.constexpr):
    # The tile's routed-row slots and which of them are real (padding slots are >= num_slots).
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ids_ptr + offs_m)
    return slot, slot < num_slots


@triton.jit
def _w_scale_ptrs(w_scale_ptr, expert, rows, stride_wse, stride_wsn, SCALE_BLOCK_N: tl.constexpr):
    # Block-scale row of each weight row (one fp32 scale per SCALE_BLOCK_N x SCALE_BLOCK_K tile).
    return w_scale_ptr + expert * stride_wse + (rows // SCALE_BLOCK_N) * stride_wsn


@triton.jit
def _load_a(a_ptrs, row_ok, offs_k, k_left, EVEN_K: tl.constexpr):
    # Activation tile [BLOCK_M, BLOCK_K]; with a ragged K the columns past k_left read 0.
    if EVEN_K:
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < k_left)[None, :], other=0.0)
    return a


@triton.jit
def _load_w(w_ptrs, offs_k, k_left, EVEN_K: tl.constexpr):
    # Weight tile [BLOCK_K, BLOCK_N] (rows wrapped in N, so only K needs a mask).
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=(offs_k < k_left)[:, None], other=0.0)
    return w


@triton.jit
def _scaled_dot(acc, a, w, a_s, w_s):
    # FP8: each K block's product is scaled by its activation-group and weight-block scales
    # before it is added (the scales change from one K block to the next).
    return acc + tl.dot(a, w) * (a_s[:, None] * w_s[None, :])


@triton.jit
def _times_topk_weight(acc, topk_weights_ptr, rows, row_ok):
    # GEMM 2's [routed rows, columns] tile times each routed row's top-k weight.
    weight = tl.load(topk_weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    return acc * weight[:, None]


@triton.jit
def _store_tile(out_ptr, rows, offs_n, n_cols, row_ok, stride_om, stride_on, val):
    # The tile in out's dtype; padding rows and the wrapped columns past n_cols are not written.
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(
        out_ptrs,
        val.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_n[None, :] < n_cols),
    )


@triton.jit
def _moe_gemm1_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    num_slots,
    num_m_blocks,
    n_cols,  # I: gate columns; the up rows start I rows after the gate rows
    k_dim,  # H
    top_k,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_we,
    stride_wn,
    stride_wk,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_om,
    stride_on,
    limit,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    FP8: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(num_m_blocks, n_cols, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    slot, row_ok = _tile_rows(pid_m, sorted_ids_ptr, num_slots, BLOCK_M)
    a_row = (slot // top_k).to(tl.int64)  # every slot of a token reads the token's row
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ld = offs_n % n_cols  # wrap instead of masking the weight loads; the store masks
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    g_ptrs = w_ptr + expert * stride_we + n_ld[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + n_cols * stride_wn
    if FP8:
        as_ptrs = a_scale_ptr + a_row * stride_asm
        gs_ptrs = _w_scale_ptrs(w_scale_ptr, expert, n_ld, stride_wse, stride_wsn, SCALE_BLOCK_N)
        us_ptrs = _w_scale_ptrs(
            w_scale_ptr, expert, n_ld + n_cols, stride_wse, stride_wsn, SCALE_BLOCK_N
        )

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(tl.cdiv(k_dim, BLOCK_K)):
        k_left = k_dim - kb * BLOCK_K
        a = _load_a(a_ptrs, row_ok, offs_k, k_left, EVEN_K)
        bg = _load_w(g_ptrs, offs_k, k_left, EVEN_K)
        bu = _load_w(u_ptrs, offs_k, k_left, EVEN_K)
        if FP8:
            ks = (kb * BLOCK_K) // SCALE_BLOCK_K
            a_s = tl.load(as_ptrs + ks * stride_ask, mask=row_ok, other=0.0)
            g_s = tl.load(gs_ptrs + ks * stride_wsk)
            u_s = tl.load(us_ptrs + ks * stride_wsk)
            acc_g = _scaled_dot(acc_g, a, bg, a_s, g_s)
            acc_u = _scaled_dot(acc_u, a, bu, a_s, u_s)
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk

    act = gated_act(acc_g, acc_u, limit, ACTIVATION, HAS_LIMIT)
    _store_tile(out_ptr, slot.to(tl.int64), offs_n, n_cols, row_ok, stride_om, stride_on, act)


@triton.jit
def _moe_gemm2_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    num_slots,
    num_m_blocks,
    n_cols,
    k_dim,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_we,
    stride_wn,
    stride_wk,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_om,
    stride_on,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    FP8: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(num_m_blocks, n_cols, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    slot, row_ok = _tile_rows(pid_m, sorted_ids_ptr, num_slots, BLOCK_M)
    a_row = slot.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ld = offs_n % n_cols
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + n_ld[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if FP8:
        as_ptrs = a_scale_ptr + a_row * stride_asm
        ws_ptrs = _w_scale_ptrs(w_scale_ptr, expert, n_ld, stride_wse, stride_wsn, SCALE_BLOCK_N)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(tl.cdiv(k_dim, BLOCK_K)):
        k_left = k_dim - kb * BLOCK_K
        a = _load_a(a_ptrs, row_ok, offs_k, k_left, EVEN_K)
        b = _load_w(w_ptrs, offs_k, k_left, EVEN_K)
        if FP8:
            ks = (kb * BLOCK_K) // SCALE_BLOCK_K
            a_s = tl.load(as_ptrs + ks * stride_ask, mask=row_ok, other=0.0)
            w_s = tl.load(ws_ptrs + ks * stride_wsk)
            acc = _scaled_dot(acc, a, b, a_s, w_s)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    acc = _times_topk_weight(acc, topk_weights_ptr, a_row, row_ok)
    _store_tile(out_ptr, a_row, offs_n, n_cols, row_ok, stride_om, stride_on, acc)


@triton.jit
def _moe_sum_kernel(
    x_ptr,
    ids_ptr,
    out_ptr,
    n_cols,
    num_experts,
    stride_xm,
    stride_om,
    stride_on,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        # The slot's id, broadcast over the block: masked slots (-1) were never computed.
        e = tl.load(ids_ptr + token * TOP_K + s + tl.zeros((BLOCK,), dtype=tl.int32))
        routed = mask & (e >= 0) & (e < num_experts)
        v = tl.load(x_ptr + (token * TOP_K + s) * stride_xm + offs, mask=routed, other=0.0)
        acc += v.to(tl.float32)
    tl.store(
        out_ptr + token * stride_om + offs * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask
    )


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEProblem:
    tokens: int
    hidden: int
    inter: int
    num_experts: int
    top_k: int
    fp8: bool
    block: tuple[int, int]


def check_routing_and_out(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """What every MoE entry point checks of its routing and output, a ``ValueError`` naming what
    does not fit: ``topk_ids`` / ``topk_weights`` [T, k] for ``hidden`` [T, H], ``out`` (when
    given) of ``hidden``'s shape and dtype."""
    tokens = hidden.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids/topk_weights must be [T, k] with T={tokens}, got "
            f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}"
        )
    if out is not None and (out.shape != hidden.shape or out.dtype != hidden.dtype):
        raise ValueError(
            f"out must match hidden: {tuple(out.shape)} {out.dtype} vs "
            f"{tuple(hidden.shape)} {hidden.dtype}"
        )


def check_moe_inputs(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    block_shape: tuple[int, int] | list[int] | None,
    out: torch.Tensor | None,
) -> MoEProblem:
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got {tuple(hidden.shape)}")
    tokens, h = hidden.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"w13/w2 must be [E, 2I, H] / [E, H, I], got {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    e, two_i, h1 = w13.shape
    i = two_i // 2
    if two_i % 2 or h1 != h or tuple(w2.shape) != (e, h, i):
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}"
        )
    check_routing_and_out(hidden, topk_weights, topk_ids, out)
    fp8 = w13.dtype == FP8_DTYPE
    if (w2.dtype == FP8_DTYPE) != fp8:
        raise ValueError(f"w13 and w2 must both be FP8 or neither: {w13.dtype}, {w2.dtype}")
    block = tuple(block_shape) if block_shape is not None else DEFAULT_FP8_BLOCK
    if fp8:
        if w13_scale is None or w2_scale is None:
            raise ValueError("FP8 weights need w13_scale and w2_scale")
        bn, bk = int(block[0]), int(block[1])
        want13 = (e, triton.cdiv(two_i, bn), triton.cdiv(h, bk))
        want2 = (e, triton.cdiv(h, bn), triton.cdiv(i, bk))
        if tuple(w13_scale.shape) != want13 or tuple(w2_scale.shape) != want2:
            raise ValueError(
                f"block scales {tuple(w13_scale.shape)}, {tuple(w2_scale.shape)} do not match "
                f"{want13}, {want2} for block {block}"
            )
        if h % bk or i % bk:
            raise ValueError(f"FP8 activations are quantised in groups of {bk}: H={h}, I={i}")
    elif w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"unquantised weights must match hidden's dtype {hidden.dtype}")
    return MoEProblem(tokens, h, i, e, topk_ids.shape[1], fp8, (int(block[0]), int(block[1])))


def resolve_moe_output(
    hidden: torch.Tensor, inplace: bool, out: torch.Tensor | None
) -> torch.Tensor:
    if inplace:
        if out is not None and out.data_ptr() != hidden.data_ptr():
            raise ValueError("inplace=True writes into hidden; do not also pass a different out")
        return hidden
    return out if out is not None else torch.empty_like(hidden)


def routing_operands(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing as the kernels read it: contiguous int32 ids and fp32 weights."""
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    return ids.contiguous(), topk_weights.float().contiguous()


def _launch_expert_gemm(
    kernel: JITFunction[Any],
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    out: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    p: MoEProblem,
    num_slots: int,
    cfg: FusedMoeConfig,
    tile: GemmTile,
    n_cols: int,
    k_dim: int,
    **extra: Any,
) -> None:
    """Launch one of the two GEMM kernels (same argument names) with what both share; ``extra``
    holds the kernel's own arguments."""
    sorted_ids, expert_ids, ntpp = align
    block_k = min(tile.block_k, p.block[1]) if p.fp8 else tile.block_k
    num_m_blocks = expert_ids.shape[0]
    grid = (num_m_blocks * triton.cdiv(n_cols, tile.block_n),)
    # Without FP8 the scale pointers are never read: the operands stand in for them.
    scale_a = a_scale if a_scale is not None else a
    scale_w = w_scale if w_scale is not None else w
    kernel[grid](
        a_ptr=a,
        a_scale_ptr=scale_a,
        w_ptr=w,
        w_scale_ptr=scale_w,
        out_ptr=out,
        sorted_ids_ptr=sorted_ids,
        expert_ids_ptr=expert_ids,
        ntpp_ptr=ntpp,
        num_slots=num_slots,
        num_m_blocks=num_m_blocks,
        n_cols=n_cols,
        k_dim=k_dim,
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_asm=scale_a.stride(0) if p.fp8 else 0,
        stride_ask=scale_a.stride(1) if p.fp8 else 0,
        stride_we=w.stride(0),
        stride_wn=w.stride(1),
        stride_wk=w.stride(2),
        stride_wse=scale_w.stride(0) if p.fp8 else 0,
        stride_wsn=scale_w.stride(1) if p.fp8 else 0,
        stride_wsk=scale_w.stride(2) if p.fp8 else 0,
        stride_om=out.stride(0),
        stride_on=out.stride(1),
        SCALE_BLOCK_N=p.block[0],
        SCALE_BLOCK_K=p.block[1],
        FP8=p.fp8,
        EVEN_K=k_dim % block_k == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=block_k,
        GROUP_M=tile.group_m,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **extra,
    )


def launch_gemm1(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    inter_out: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    p: MoEProblem,
    num_slots: int,
    cfg: FusedMoeConfig,
    act: int,
    limit: float | None,
) -> None:
    _launch_expert_gemm(
        _moe_gemm1_kernel,
        a,
        a_scale,
        w13,
        w13_scale,
        inter_out,
        align,
        p,
        num_slots,
        cfg,
        cfg.gemm1,
        n_cols=p.inter,
        k_dim=p.hidden,
        top_k=p.top_k,
        limit=float(limit or 0.0),
        ACTIVATION=act,
        HAS_LIMIT=limit is not None,
    )


def launch_gemm2(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    down_out: torch.Tensor,
    topk_weights: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    p: MoEProblem,
    num_slots: int,
    cfg: FusedMoeConfig,
) -> None:
    _launch_expert_gemm(
        _moe_gemm2_kernel,
        a,
        a_scale,
        w2,
        w2_scale,
        down_out,
        align,
        p,
        num_slots,
        cfg,
        cfg.gemm2,
        n_cols=p.hidden,
        k_dim=p.inter,
        topk_weights_ptr=topk_weights,
    )


def _launch_sum(
    down: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, p: MoEProblem
) -> None:
    tokens = out.shape[0]
    block = min(1024, triton.next_power_of_2(p.hidden))
    grid = (tokens, triton.cdiv(p.hidden, block))
    _moe_sum_kernel[grid](
        down,
        topk_ids,
        out,
        p.hidden,
        p.num_experts,
        down.stride(0),
        out.stride(0),
        out.stride(1),
        TOP_K=p.top_k,
        BLOCK=block,
        num_warps=4,
    )


def select_chunk_config(
    n_tok: int, p: MoEProblem, dtype: torch.dtype, device: torch.device
) -> FusedMoeConfig | TmaMoeConfig | None:
    """The kernel and tiles for a chunk of ``n_tok`` tokens on ``device``, fitted to its limits
    (None: no configuration fits, the torch experts run)."""
    if p.fp8 and p.block[0] != p.block[1]:
        rule = get_config(n_tok, p.num_experts, p.hidden, p.inter, dtype, top_k=p.top_k)
        return fit_two_launch(rule, dtype, limits_for(device))
    return select_moe_config(
        n_tok,
        p.num_experts,
        p.hidden,
        p.inter,
        dtype,
        top_k=p.top_k,
        device=device,
        scale_block=p.block[1],
    )


def fused_moe_unfit_reason(
    n_tok: int, p: MoEProblem, dtype: torch.dtype, device: torch.device
) -> str | None:
    """Why the Triton fused MoE does not run a chunk of ``n_tok`` tokens of problem ``p`` with
    ``dtype`` weights on ``device`` (None: it does): the family is off, or no configuration
    fits the device."""
    why = unfit_reason("fused_moe")
    if why is None and select_chunk_config(n_tok, p, dtype, device) is None:
        limits = limits_for(device)
        name = limits.name if limits is not None else str(device)
        why = f"no fused MoE tile fits {name} with {element_bytes(dtype)}-byte operands"
    return why


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "swiglu",
    swiglu_limit: float | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | list[int] | None = None,
    inplace: bool = False,
    out: torch.Tensor | None = None,
    config: FusedMoeConfig | TmaMoeConfig | None = None,
) -> torch.Tensor:
    """Routed experts: ``out[t] = sum_s topk_weights[t, s] * E_{topk_ids[t, s]}(hidden[t])`` with
    ``E_e(x) = w2[e] @ act(w13[e, :I] @ x, w13[e, I:] @ x)``.

    Shapes: ``hidden`` [T, H] (bf16), ``w13`` [E, 2I, H] (gate rows first, then up), ``w2``
    [E, H, I], ``topk_weights`` fp32 [T, k], ``topk_ids`` int32 [T, k] (ids outside [0, E), e.g.
    -1, are skipped). FP8 e4m3 weights need ``w13_scale`` [E, 2I/bn, H/bk] and ``w2_scale``
    [E, H/bn, I/bk] fp32 for ``block_shape`` (bn, bk) = (128, 128) by default.

    Output allocation contract (the caller may hand in memory from a special pool, e.g. NCCL
    symmetric memory, so this function must not allocate the result elsewhere):
      * ``inplace=True``: the result is written into ``hidden`` and ``hidden`` is returned;
      * else if ``out`` is given: the result is written into ``out`` and ``out`` is returned;
      * else: a new ``torch.empty_like(hidden)`` is returned.
    Only the intermediate caches are allocated here, with ``torch.empty`` on the default
    allocator. Off CUDA (and without ``TRITON_INTERPRET=1``) this runs :func:`fused_experts_torch`.
    The kernel and tiles per chunk come from the tuned tables (``tuned_configs.py``): the
    two-launch kernels below, or at prefill sizes the Hopper TMA kernels (``fused_moe_tma.py``).
    ``config`` overrides that choice (tuning, tests)."""
    off = unfit_reason("fused_moe") if triton_can_run(hidden) else "no CUDA tensors"
    if off is not None:
        if hidden.is_cuda:
            note_fallback("fused_moe", off, "the torch experts")
        return fused_experts_torch(
            hidden,
            w13,
            w2,
            topk_weights,
            topk_ids,
            activation=activation,
            swiglu_limit=swiglu_limit,
            w13_scale=w13_scale,
            w2_scale=w2_scale,
            block_shape=block_shape,
            inplace=inplace,
            out=out,
        )
    act = activation_code(activation, swiglu_limit)
    p = check_moe_inputs(
        hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape, out
    )
    if p.fp8 and (p.block[1] < 16 or p.block[1] & (p.block[1] - 1)):
        raise ValueError(f"the Triton path needs a power-of-two K block >= 16, got {p.block}")
    if isinstance(config, TmaMoeConfig):  # forced (tuning, tests); table picks are checked
        why = tma_config_fits(config, p.hidden, p.inter, p.fp8, p.block[1])
        if why:
            raise ValueError(f"TMA MoE config {config} cannot run: {why}")
    result = resolve_moe_output(hidden, inplace, out)
    if p.tokens == 0:
        return result
    ids, weights = routing_operands(topk_ids, topk_weights)

    chunk = min(p.tokens, CHUNK_TOKENS)
    max_slots = chunk * p.top_k
    dev, dt = hidden.device, hidden.dtype
    inter_cache: torch.Tensor | None = None  # the two-launch path's only
    down_cache = torch.empty((max_slots, p.hidden), dtype=dt, device=dev)
    for start in range(0, p.tokens, chunk):
        end = min(start + chunk, p.tokens)
        n_tok = end - start
        num_slots = n_tok * p.top_k
        cfg = config or select_chunk_config(n_tok, p, w13.dtype, hidden.device)
        chunk_ids = ids[start:end]
        if cfg is None:  # nothing fits this device (logged by the selection)
            fused_experts_torch(
                hidden[start:end],
                w13,
                w2,
                weights[start:end],
                chunk_ids,
                activation=activation,
                swiglu_limit=swiglu_limit,
                w13_scale=w13_scale,
                w2_scale=w2_scale,
                block_shape=block_shape,
                out=result[start:end],
            )
            continue
        if isinstance(cfg, TmaMoeConfig):
            down = down_cache[:num_slots]
            run_tma_chunk(
                hidden[start:end],
                chunk_ids,
                weights[start:end],
                w13,
                w2,
                w13_scale,
                w2_scale,
                down,
                cfg=cfg,
                scale_block=p.block[1],
                act=act,
                limit=swiglu_limit,
            )
            _launch_sum(down, chunk_ids, result[start:end], p)
            continue
        align = moe_align_any_order(chunk_ids, cfg.block_m, p.num_experts)
        x = hidden[start:end]
        x_scale = None
        if p.fp8:
            x, x_scale = per_token_group_quant_fp8(x, p.block[1])
        if inter_cache is None:
            inter_cache = torch.empty((max_slots, p.inter), dtype=dt, device=dev)
        inter = inter_cache[:num_slots]
        launch_gemm1(x, x_scale, w13, w13_scale, inter, align, p, num_slots, cfg, act, swiglu_limit)
        a2, a2_scale = inter, None
        if p.fp8:
            a2, a2_scale = per_token_group_quant_fp8(inter, p.block[1])
        down = down_cache[:num_slots]
        launch_gemm2(a2, a2_scale, w2, w2_scale, down, weights[start:end], align, p, num_slots, cfg)
        _launch_sum(down, chunk_ids, result[start:end], p)
    return result


# --------------------------------------------------------------------------------------------
# Torch reference (oracle for the tests, CPU path)
# --------------------------------------------------------------------------------------------


def _fake_quant_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """Quantise-dequantise per token group in torch, exactly as the Triton path sees it."""
    q, s = per_token_group_quant_fp8(x, group, use_triton=False)
    return (q.float().view(x.shape[0], -1, group) * s.unsqueeze(-1)).view(x.shape)


def fused_experts_torch(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "swiglu",
    swiglu_limit: float | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | list[int] | None = None,
    inplace: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch version of :func:`fused_experts` (same signature and output contract).

    It loops over the experts that got tokens and mirrors the kernel's roundings: fp32 GEMMs,
    the activation on fp32 gate/up, the intermediate and each weighted expert output rounded to
    ``hidden.dtype``, and with FP8 weights the block-dequantised weights and per-token-group
    quantise-dequantised activations."""
    activation_code(activation, swiglu_limit)
    p = check_moe_inputs(
        hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape, out
    )
    result = resolve_moe_output(hidden, inplace, out)
    if p.tokens == 0:
        return result

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if p.fp8:
            assert w13_scale is not None and w2_scale is not None
            return (
                block_dequant_fp8(w13[e], w13_scale[e], p.block),
                block_dequant_fp8(w2[e], w2_scale[e], p.block),
            )
        return w13[e].float(), w2[e].float()

    def gemm_input(rows: torch.Tensor) -> torch.Tensor:
        return _fake_quant_rows(rows, p.block[1]) if p.fp8 else rows.float()

    return experts_reference(
        hidden, topk_weights, topk_ids, p, result, expert, gemm_input, activation, swiglu_limit
    )


def experts_reference(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    p: MoEProblem,
    result: torch.Tensor,
    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    gemm_input: Callable[[torch.Tensor], torch.Tensor],
    activation: str,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """The torch experts every reference shares, with the kernels' roundings: for each used
    expert (``expert(e)``: its fp32 ``w13`` [2I, H] and ``w2`` [H, I]) fp32 GEMMs on the inputs
    as the kernels read them (``gemm_input``: hidden and the intermediate, fp32), the activation
    on fp32 gate/up, the intermediate and each weighted expert output rounded to ``hidden``'s
    dtype, the k rows summed in fp32 into ``result``."""
    dt = hidden.dtype
    x = gemm_input(hidden)
    ids = topk_ids.long()
    acc = torch.zeros((p.tokens, p.hidden), dtype=torch.float32, device=hidden.device)
    routed = (ids >= 0) & (ids < p.num_experts)
    for e in torch.unique(ids[routed]).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13_e, w2_e = expert(e)
        gate_up = x[tok] @ w13_e.t()
        h = gemm_input(act_and_mul_reference(gate_up, activation, swiglu_limit).to(dt))
        y = (h @ w2_e.t()) * topk_weights[tok, slot].float().unsqueeze(-1)
        acc.index_add_(0, tok, y.to(dt).float())
    result.copy_(acc.to(dt))
    return result
