"""Hopper grouped GEMMs for prefill-sized MoE: TMA weight loads, a persistent expert-ordered grid,
and a gate-up epilogue that writes the FP8 intermediate itself.

Both kernels walk the tiles of the expert-sorted rows (``moe_align_block_size``):

* gate-up: ``A`` rows are gathered by token (pointer loads), the gate and up weight tiles come
  through one tensor descriptor over ``w13`` viewed as ``[E*2I, H]``. The epilogue applies the
  gated activation and writes the intermediate in *sorted* row order ``[P, I]`` (row = position in
  ``sorted_token_ids``), so the down GEMM reads its ``A`` as plain contiguous tiles. With FP8 the
  epilogue also quantises each row's 128-column groups (the ``quant_rows_fp8`` rule of the
  activation quantiser, on the bf16-rounded values) and writes the e4m3 tile and its scales:
  no separate requantisation pass.
* down: ``A`` (the sorted intermediate) and ``w2`` viewed as ``[E*H, I]`` both through tensor
  descriptors; the epilogue multiplies each row by its top-k weight and scatters it to its
  (token, slot) row.

Tile order: ``GROUP_M`` consecutive row tiles (rows of one expert, or of neighbouring experts)
for each column tile before the next, so the weight tile a wave reads is shared by the row tiles
running at the same time and is fetched from HBM about once. With ``NUM_PROGRAMS`` below the tile
count the grid is persistent: each program loops over tiles ``pid, pid + NUM_PROGRAMS, ...``.
Row tiles are ``BLOCK_M`` rows of one expert, or with ``HALF_TILES`` taken from a tile table in
which an expert's last tile may be ``BLOCK_M / 2`` rows (``moe_align_half_tiles``): each tile
runs one of two bodies compiled for the two heights, so padding stays under half a tile.
FP8 scales are applied per K block (``BLOCK_K`` divides the 128-wide scale block), in one of two
ways (``TmaGemmTile.rescale``): each K block's product in a fresh accumulator, scaled and added to
the running one (two accumulators live), or one accumulator that is re-expressed over the next K
block's scales before the MMA adds that block's product into it (the running-rescale of online
softmax): one accumulator, so 128-row FP8 tiles fit the registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.fit.footprint import Footprint, tma_pipeline_shared
from sglang.kernels.fit.limits import DeviceLimits
from sglang.kernels.ops.activation import gated_act
from sglang.kernels.ops.quant.fp8 import DEFAULT_EPS, FP8_DTYPE, quant_rows_fp8
from sglang.kernels.ops.tile_order import grouped_tile


@dataclass(frozen=True)
class TmaGemmTile:
    """One GEMM's launch: tile, swizzle group, warps, pipeline depth; ``persistent`` runs one
    program per SM looping over tiles (else one program a tile); ``warp_specialize`` asks
    Triton for producer/consumer warps on the persistent loop; ``paired`` (gate-up) loads the
    gate and up tiles as one 3-D block and runs one dot twice as wide; ``rescale`` (FP8) keeps
    one accumulator per output tile instead of two (see the module docstring): it needs the
    tile's columns in one weight scale block, so split gate-up tiles of the block's width and
    down tiles no wider than it; bf16 ignores it."""

    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    persistent: bool = True
    warp_specialize: bool = False
    paired: bool = False  # gate-up only: gate and up tiles in one 3-D load and one wide dot
    rescale: bool = False  # FP8: one accumulator, rescaled between K blocks (module doc)


@dataclass(frozen=True)
class TmaMoeConfig:
    """``block_m`` is shared: it is the alignment of the sorted rows both GEMMs walk.
    ``sorted_a``: the gate-up GEMM reads its activations from a copy gathered in sorted row order
    by one pass before it (``sorted_rows.py``; FP8 quantises in that pass), as plain tiles
    through a tensor descriptor, instead of gathering rows by token in its K loop, whose pointer
    tile holds registers that 128-row tiles need (ptxas: FP8 64x128 gate-up 316 bytes of spills
    gathered, none sorted).
    ``half_tiles``: segments padded to ``block_m / 2`` and an expert's last row tile half height
    when that covers it (``moe_align_half_tiles``): at 192 rows an expert, 192 rows computed
    instead of 256. The kernels then branch per tile between two tile bodies."""

    block_m: int
    gemm1: TmaGemmTile
    gemm2: TmaGemmTile
    sorted_a: bool = False
    half_tiles: bool = False


# Scales below this are raised to it before dividing by them (a checkpoint's all-zero weight block
# may store scale 0): the block's product is ~0 either way, and the running accumulator, held in
# units of the current scales, stays far inside fp32's range.
MIN_SCALE = tl.constexpr(1e-20)


@triton.jit
def _fp8_kblock(acc, a, w, a_s, w_s, prev_a, prev_w, RESCALE: tl.constexpr):
    """Adds one K block's ``a @ w.T`` with row scales ``a_s`` [M] and the weight scale ``w_s``.

    RESCALE (``w_s`` one scalar: the tile's columns lie in one scale block): ``acc`` holds the sum
    so far divided by ``prev_a[:, None] * prev_w``; it is moved to the new scales and the MMA
    accumulates the unscaled product into it; returns the scales ``acc`` is now held in. Else
    (``w_s`` [N]) the product goes to a fresh accumulator that is scaled and added; the ``prev``
    scales come back unchanged."""
    if RESCALE:
        a_s = tl.maximum(a_s, MIN_SCALE)
        w_s = tl.maximum(w_s, MIN_SCALE)
        acc = acc * ((prev_a / a_s) * (prev_w / w_s))[:, None]
        acc = tl.dot(a, w.T, acc)
        prev_a, prev_w = a_s, w_s
    else:
        acc += tl.dot(a, w.T) * (a_s[:, None] * w_s[None, :])
    return acc, prev_a, prev_w


@triton.jit
def _fp8_unscaled(acc, prev_a, prev_w, RESCALE: tl.constexpr):
    if RESCALE:
        acc = acc * (prev_a * prev_w)[:, None]
    return acc


@triton.jit
def _a_tile(a_src, row0, k0, row_ok, A_SORTED: tl.constexpr):
    # The gate-up's activation tile at K offset k0: a plain descriptor tile of rows gathered in
    # sorted order beforehand (A_SORTED), else the rows gathered by token (padding rows 0).
    if A_SORTED:
        a = a_src.load([row0, k0])
    else:
        a = tl.load(a_src + k0, mask=row_ok[:, None], other=0.0)
    return a


@triton.jit
def _gate_up_split(
    operands,
    SCALE_BLOCK: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    A_SORTED: tl.constexpr,
    RESCALE: tl.constexpr,
):
    (a_src, row0, as_ptrs, row_ok, w_desc, ws_base, stride_wsn, expert, pid_n, inter,
     k_steps) = operands  # fmt: skip
    # Gate and up tiles as two loads and two dots over a 2-D descriptor on w13 [E*2I, H].
    gate_row = expert * (2 * inter) + pid_n * BLOCK_N
    up_row = gate_row + inter
    if FP8:
        if RESCALE:  # the tile's gate (up) columns lie in one scale block: one scale each
            gs_ptrs = ws_base + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_wsn
            us_ptrs = ws_base + ((pid_n * BLOCK_N + inter) // SCALE_BLOCK) * stride_wsn
        else:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            gs_ptrs = ws_base + (cols // SCALE_BLOCK) * stride_wsn
            us_ptrs = ws_base + ((cols + inter) // SCALE_BLOCK) * stride_wsn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sa = tl.full((BLOCK_M,), 1.0, tl.float32)  # the scales acc_g / acc_u are held in (RESCALE)
    sg = tl.full((), 1.0, tl.float32)
    su = tl.full((), 1.0, tl.float32)
    for kb in range(k_steps):
        k0 = kb * BLOCK_K
        a = _a_tile(a_src, row0, k0, row_ok, A_SORTED)
        wg = w_desc.load([gate_row, k0])
        wu = w_desc.load([up_row, k0])
        if FP8:
            ks = k0 // SCALE_BLOCK
            a_s = tl.load(as_ptrs + ks, mask=row_ok, other=1.0)
            g_s = tl.load(gs_ptrs + ks)
            u_s = tl.load(us_ptrs + ks)
            # Both read the row scales ``sa`` held so far; the second call moves them on.
            acc_g, _, sg = _fp8_kblock(acc_g, a, wg, a_s, g_s, sa, sg, RESCALE)
            acc_u, sa, su = _fp8_kblock(acc_u, a, wu, a_s, u_s, sa, su, RESCALE)
        else:
            acc_g = tl.dot(a, wg.T, acc_g)
            acc_u = tl.dot(a, wu.T, acc_u)
    if FP8:
        acc_g = _fp8_unscaled(acc_g, sa, sg, RESCALE)
        acc_u = _fp8_unscaled(acc_u, sa, su, RESCALE)
    return acc_g, acc_u


@triton.jit
def _gate_up_paired(
    operands,
    SCALE_BLOCK: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    A_SORTED: tl.constexpr,
):
    (a_src, row0, as_ptrs, row_ok, w_desc, ws_base, stride_wsn, expert, pid_n, inter,
     k_steps) = operands  # fmt: skip
    # Gate and up tiles in one load over a 3-D descriptor on w13 viewed [E*2, I, H] (block
    # [2, BLOCK_N, BLOCK_K]) and one dot [BLOCK_M, 2*BLOCK_N]: the tensor cores see one wide
    # tile, as a plain GEMM over the stacked gate-up rows would.
    n0 = pid_n * BLOCK_N
    if FP8:
        j = tl.arange(0, 2 * BLOCK_N)
        w_rows = tl.where(j < BLOCK_N, n0 + j, inter + n0 + j - BLOCK_N)
        ws_ptrs = ws_base + (w_rows // SCALE_BLOCK) * stride_wsn
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for kb in range(k_steps):
        k0 = kb * BLOCK_K
        a = _a_tile(a_src, row0, k0, row_ok, A_SORTED)
        w = tl.reshape(w_desc.load([2 * expert, n0, k0]), (2 * BLOCK_N, BLOCK_K))
        if FP8:
            ks = k0 // SCALE_BLOCK
            a_s = tl.load(as_ptrs + ks, mask=row_ok, other=0.0)
            w_s = tl.load(ws_ptrs + ks)
            acc += tl.dot(a, w.T) * (a_s[:, None] * w_s[None, :])
        else:
            acc = tl.dot(a, w.T, acc)
    gate_up = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1))
    acc_g, acc_u = tl.split(gate_up)
    return acc_g, acc_u


@triton.jit
def _tile_space(
    ntpp_ptr, n_cols, k_dim, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, HALF_TILES: tl.constexpr,
):  # fmt: skip
    """``(row tiles, column tiles, tiles, K steps)`` a kernel walks: with HALF_TILES the tile
    table's length (``ntpp_ptr`` holds it), else the used part of the sorted rows in ``BLOCK_M``
    blocks; ``n_cols`` in ``BLOCK_N`` columns."""
    if HALF_TILES:
        num_m_blocks = tl.load(ntpp_ptr)
    else:
        num_m_blocks = tl.load(ntpp_ptr) // BLOCK_M  # only the used part of the sorted rows
    num_n_blocks = n_cols // BLOCK_N
    return num_m_blocks, num_n_blocks, num_m_blocks * num_n_blocks, k_dim // BLOCK_K


@triton.jit
def _tile_at(
    tile, num_m_blocks, num_n_blocks, expert_ids_ptr, BLOCK_M: tl.constexpr,
    GROUP_M: tl.constexpr, HALF_TILES: tl.constexpr,
):  # fmt: skip
    """Tile ``tile`` in the grouped order -> ``(row tile, column tile, first row, expert)``: the
    row tile's first row and expert from the tile table of ``moe_align_half_tiles`` (rows
    ``(first row, expert, half)``) with HALF_TILES, else the ``BLOCK_M``-row blocks of
    ``moe_align_block_size`` (``expert_ids`` per block)."""
    pid_m, pid_n = grouped_tile(tile, num_m_blocks, num_n_blocks, GROUP_M)
    if HALF_TILES:
        row0 = tl.load(expert_ids_ptr + 3 * pid_m)
        expert = tl.load(expert_ids_ptr + 3 * pid_m + 1)
    else:
        row0 = pid_m * BLOCK_M
        expert = tl.load(expert_ids_ptr + pid_m)
    return pid_m, pid_n, row0, expert


@triton.jit
def _gate_up_tile(
    a_ptr,
    args,
    SCALE_BLOCK: tl.constexpr,
    FP8: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PAIRED: tl.constexpr,
    RESCALE: tl.constexpr,
    A_SORTED: tl.constexpr,
):
    # ``args``: the kernel's runtime arguments and this tile's coordinates (one tuple, as the
    # kernel passes it to each of its tile bodies).
    (a_scale_ptr, w_desc, w_scale_ptr, out_ptr, out_scale_ptr, sorted_ids_ptr, row0, expert,
     pid_n, num_slots, inter, top_k, k_steps, stride_am, stride_asm, stride_wse, stride_wsn,
     stride_om, stride_osm, limit, eps) = args  # fmt: skip
    # One [BLOCK_M, BLOCK_N] output tile of rows row0.. (one expert's) through the epilogue.
    pos = row0 + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ids_ptr + pos)
    row_ok = slot < num_slots
    if A_SORTED:  # ``a_ptr`` is a tensor descriptor over the sorted rows [P, H]
        a_src = a_ptr
        as_ptrs = a_scale_ptr + pos.to(tl.int64) * stride_asm
    else:  # gathered by token, row by row
        a_row = (slot // top_k).to(tl.int64)
        a_src = a_ptr + a_row[:, None] * stride_am + tl.arange(0, BLOCK_K)[None, :]
        as_ptrs = a_scale_ptr + a_row * stride_asm
    ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
    # The gate-up products' runtime operands, one tuple for either form.
    operands = (a_src, row0, as_ptrs, row_ok, w_desc, ws_base, stride_wsn, expert, pid_n, inter,
                k_steps)  # fmt: skip
    if PAIRED:
        acc_g, acc_u = _gate_up_paired(
            operands,
            SCALE_BLOCK,
            FP8,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            A_SORTED,
        )
    else:
        acc_g, acc_u = _gate_up_split(
            operands,
            SCALE_BLOCK,
            FP8,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            A_SORTED,
            RESCALE,
        )
    act = gated_act(acc_g, acc_u, limit, ACTIVATION, HAS_LIMIT)
    # Padding rows computed act(0, 0) = 0: they are written too, so the down GEMM reads
    # whole tiles (their products are never stored).
    out_rows = pos.to(tl.int64)
    out_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + out_cols[None, :]
    if FP8:
        # The bf16 rounding the unfused path stores, then that path's per-128 quantisation.
        h = act.to(tl.bfloat16).to(tl.float32)
        groups: tl.constexpr = BLOCK_N // SCALE_BLOCK
        q, s = quant_rows_fp8(tl.reshape(h, (BLOCK_M * groups, SCALE_BLOCK)), eps)
        tl.store(out_ptrs, tl.reshape(q, (BLOCK_M, BLOCK_N)).to(out_ptr.dtype.element_ty))
        g_idx = pid_n * groups + tl.arange(0, groups)
        s_ptrs = out_scale_ptr + out_rows[:, None] * stride_osm + g_idx[None, :]
        tl.store(s_ptrs, tl.reshape(s, (BLOCK_M, groups)))
    else:
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty))


@triton.jit
def _gate_up_tma_kernel(
    a_ptr,
    a_half_ptr,
    a_scale_ptr,
    w_desc,
    w_scale_ptr,
    out_ptr,
    out_scale_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    num_slots,
    inter,
    k_dim,
    top_k,
    stride_am,
    stride_asm,
    stride_wse,
    stride_wsn,
    stride_om,
    stride_osm,
    limit,
    eps,
    SCALE_BLOCK: tl.constexpr,
    FP8: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    PAIRED: tl.constexpr,
    RESCALE: tl.constexpr,
    A_SORTED: tl.constexpr,
    HALF_TILES: tl.constexpr,
):
    # HALF_TILES: ``expert_ids_ptr`` is the tile table and ``ntpp_ptr`` its length (align.py);
    # ``a_half_ptr`` is the half-height descriptor of the sorted rows (A_SORTED).
    num_m_blocks, num_n_blocks, num_tiles, k_steps = _tile_space(
        ntpp_ptr, inter, k_dim, BLOCK_M, BLOCK_N, BLOCK_K, HALF_TILES
    )
    for tile in tl.range(
        tl.program_id(0), num_tiles, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE
    ):
        pid_m, pid_n, row0, expert = _tile_at(
            tile, num_m_blocks, num_n_blocks, expert_ids_ptr, BLOCK_M, GROUP_M, HALF_TILES
        )
        args = (
            a_scale_ptr, w_desc, w_scale_ptr, out_ptr, out_scale_ptr, sorted_ids_ptr, row0, expert,
            pid_n, num_slots, inter, top_k, k_steps, stride_am, stride_asm, stride_wse,
            stride_wsn, stride_om, stride_osm, limit, eps,
        )  # fmt: skip
        if HALF_TILES:  # the tile table says which of two bodies a tile runs
            if tl.load(expert_ids_ptr + 3 * pid_m + 2) != 0:
                _gate_up_tile(
                    a_half_ptr, args, SCALE_BLOCK, FP8, ACTIVATION, HAS_LIMIT, BLOCK_M // 2,
                    BLOCK_N, BLOCK_K, PAIRED, RESCALE, A_SORTED,
                )  # fmt: skip
            else:
                _gate_up_tile(
                    a_ptr, args, SCALE_BLOCK, FP8, ACTIVATION, HAS_LIMIT, BLOCK_M, BLOCK_N,
                    BLOCK_K, PAIRED, RESCALE, A_SORTED,
                )  # fmt: skip
        else:
            _gate_up_tile(
                a_ptr, args, SCALE_BLOCK, FP8, ACTIVATION, HAS_LIMIT, BLOCK_M, BLOCK_N, BLOCK_K,
                PAIRED, RESCALE, A_SORTED,
            )  # fmt: skip


@triton.jit
def _down_tile(
    a_desc,
    args,
    SCALE_BLOCK: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RESCALE: tl.constexpr,
):
    # ``args`` as for ``_gate_up_tile``.
    (a_scale_ptr, w_desc, w_scale_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, row0, expert,
     pid_n, num_slots, n_cols, k_steps, stride_asm, stride_wse, stride_wsn,
     stride_om) = args  # fmt: skip
    w_row = expert * n_cols + pid_n * BLOCK_N
    if FP8:
        pos = row0 + tl.arange(0, BLOCK_M)
        as_ptrs = a_scale_ptr + pos.to(tl.int64) * stride_asm
        ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
        if RESCALE:  # the tile's columns lie in one scale block: one weight scale
            ws_ptrs = ws_base + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_wsn
        else:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            ws_ptrs = ws_base + (cols // SCALE_BLOCK) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sa = tl.full((BLOCK_M,), 1.0, tl.float32)  # the scales acc is held in (RESCALE)
    sw = tl.full((), 1.0, tl.float32)
    for kb in range(k_steps):
        k0 = kb * BLOCK_K
        a = a_desc.load([row0, k0])
        w = w_desc.load([w_row, k0])
        if FP8:
            ks = k0 // SCALE_BLOCK
            a_s = tl.load(as_ptrs + ks)
            w_s = tl.load(ws_ptrs + ks)
            acc, sa, sw = _fp8_kblock(acc, a, w, a_s, w_s, sa, sw, RESCALE)
        else:
            acc = tl.dot(a, w.T, acc)
    if FP8:
        acc = _fp8_unscaled(acc, sa, sw, RESCALE)
    slot = tl.load(sorted_ids_ptr + row0 + tl.arange(0, BLOCK_M))
    row_ok = slot < num_slots
    weight = tl.load(topk_weights_ptr + slot, mask=row_ok, other=0.0)
    acc = acc * weight[:, None]
    out_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + slot.to(tl.int64)[:, None] * stride_om + out_cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _down_tma_kernel(
    a_desc,
    a_half_desc,
    a_scale_ptr,
    w_desc,
    w_scale_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    num_slots,
    n_cols,
    k_dim,
    stride_asm,
    stride_wse,
    stride_wsn,
    stride_om,
    SCALE_BLOCK: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    RESCALE: tl.constexpr,
    HALF_TILES: tl.constexpr,
):
    # HALF_TILES as in the gate-up kernel; ``a_half_desc`` reads half-height row tiles.
    num_m_blocks, num_n_blocks, num_tiles, k_steps = _tile_space(
        ntpp_ptr, n_cols, k_dim, BLOCK_M, BLOCK_N, BLOCK_K, HALF_TILES
    )
    for tile in tl.range(
        tl.program_id(0), num_tiles, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE
    ):
        pid_m, pid_n, row0, expert = _tile_at(
            tile, num_m_blocks, num_n_blocks, expert_ids_ptr, BLOCK_M, GROUP_M, HALF_TILES
        )
        args = (
            a_scale_ptr, w_desc, w_scale_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, row0,
            expert, pid_n, num_slots, n_cols, k_steps, stride_asm, stride_wse, stride_wsn,
            stride_om,
        )  # fmt: skip
        if HALF_TILES:  # the tile table says which of two bodies a tile runs
            if tl.load(expert_ids_ptr + 3 * pid_m + 2) != 0:
                _down_tile(
                    a_half_desc, args, SCALE_BLOCK, FP8, BLOCK_M // 2, BLOCK_N, BLOCK_K, RESCALE
                )
            else:
                _down_tile(a_desc, args, SCALE_BLOCK, FP8, BLOCK_M, BLOCK_N, BLOCK_K, RESCALE)
        else:
            _down_tile(a_desc, args, SCALE_BLOCK, FP8, BLOCK_M, BLOCK_N, BLOCK_K, RESCALE)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def tma_config_fits(cfg: TmaMoeConfig, hidden: int, inter: int, fp8: bool, scale_block: int) -> str:
    """Why ``cfg`` cannot run these shapes ('' when it can): the kernels take whole tiles."""
    g1, g2 = cfg.gemm1, cfg.gemm2
    if cfg.half_tiles:
        if cfg.block_m % 32:
            return f"half tiles need block_m a multiple of 32 (16-row dots), got {cfg.block_m}"
        if g1.warp_specialize or g2.warp_specialize:
            return "half tiles branch per tile; warp-specialised loops are not built for that"
    if inter % g1.block_n or hidden % g1.block_k:
        return f"gate-up tile {g1.block_n}x{g1.block_k} does not divide I={inter}, H={hidden}"
    if hidden % g2.block_n or inter % g2.block_k:
        return f"down tile {g2.block_n}x{g2.block_k} does not divide H={hidden}, I={inter}"
    if fp8:
        if scale_block % g1.block_k or scale_block % g2.block_k:
            return f"K blocks {g1.block_k}/{g2.block_k} must divide the scale block {scale_block}"
        if g1.block_n % scale_block:
            return f"the fused quantiser needs gate-up block_n a multiple of {scale_block}"
        if g1.rescale and (g1.paired or g1.block_n != scale_block):
            return f"a rescaled gate-up takes split tiles of block_n {scale_block}"
        if g2.rescale and scale_block % g2.block_n:
            return f"a rescaled down tile's block_n must divide the scale block {scale_block}"
    return ""


def tma_footprints(cfg: TmaMoeConfig, fp8: bool) -> tuple[Footprint, Footprint]:
    """(gate-up, down) programs at ``cfg``: per pipeline stage an activation tile
    ``[block_m, block_k]`` and the weight tiles (gate and up: two ``[block_n, block_k]``)."""
    elem = 1 if fp8 else 2
    g1, g2 = cfg.gemm1, cfg.gemm2
    up = (cfg.block_m + 2 * g1.block_n) * g1.block_k * elem
    down = (cfg.block_m + g2.block_n) * g2.block_k * elem
    return (
        Footprint(tma_pipeline_shared(stage_bytes=up, num_stages=g1.num_stages), g1.num_warps),
        Footprint(tma_pipeline_shared(stage_bytes=down, num_stages=g2.num_stages), g2.num_warps),
    )


def tma_unfit_reason(
    cfg: TmaMoeConfig,
    hidden: int,
    inter: int,
    fp8: bool,
    scale_block: int,
    limits: DeviceLimits | None,
) -> str | None:
    """Why the TMA kernels must not run ``cfg`` here (None: they may): shapes
    (:func:`tma_config_fits`), the family turned off, a program over the device's limits, or a GPU
    before Hopper (tensor descriptors)."""
    why = tma_config_fits(cfg, hidden, inter, fp8, scale_block)
    if why:
        return why
    if limits is not None and not limits.hopper_or_newer:
        return f"TMA tensor descriptors need Hopper, {limits.name} is {limits.sm}"
    up, down = tma_footprints(cfg, fp8)
    return unfit_reason("fused_moe_tma", up, limits, what=f"TMA gate-up {cfg.gemm1}") or (
        unfit_reason("fused_moe_tma", down, limits, what=f"TMA down {cfg.gemm2}")
    )


def _tile_walk(
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tiles: tuple[torch.Tensor, torch.Tensor] | None,
    tile: TmaGemmTile,
    n_cols: int,
    num_sms: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What a kernel walks: ``(sorted_ids, row tiles, their count, programs)``, the row tiles
    ``align``'s ``block_m``-row blocks or the half-tile table ``tiles``; programs one a tile, or
    with ``tile.persistent`` at most one an SM (looping over the tiles)."""
    sorted_ids, expert_ids, ntpp = align
    if tiles is not None:
        expert_ids, ntpp = tiles
    max_tiles = expert_ids.shape[0] * (n_cols // tile.block_n)
    programs = max(1, min(max_tiles, num_sms) if tile.persistent else max_tiles)
    return sorted_ids, expert_ids, ntpp, programs


def _sorted_row_descs(
    a: torch.Tensor, block_m: int, block_k: int, half_tiles: bool
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """Tensor descriptors over rows ``a`` [P, K] in sorted order: ``block_m``-row tiles and the
    half-height ones (with ``half_tiles``; else the same descriptor)."""
    desc = TensorDescriptor.from_tensor(a, [block_m, block_k])
    half = TensorDescriptor.from_tensor(a, [block_m // 2, block_k]) if half_tiles else desc
    return desc, half


def launch_gate_up_tma(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    out: torch.Tensor,
    out_scale: torch.Tensor | None,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    num_slots: int,
    top_k: int,
    block_m: int,
    tile: TmaGemmTile,
    scale_block: int,
    act: int,
    limit: float | None,
    num_sms: int,
    a_sorted: bool = False,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``out`` [P, I] in sorted row order (bf16, or e4m3 with ``out_scale`` [P, I/128] fp32).
    ``a`` is [T, H] by token, or with ``a_sorted`` [P, H] in sorted order (``sorted_rows``).
    ``tiles``: the half-tile table and its length (``moe_align_half_tiles``, ``align`` then to
    ``block_m / 2``); without it, ``align``'s ``block_m``-row blocks."""
    e, two_i, h = w13.shape
    inter = two_i // 2
    fp8 = w13.dtype == FP8_DTYPE
    if tile.paired:
        w_desc = TensorDescriptor.from_tensor(
            w13.view(e * 2, inter, h), [2, tile.block_n, tile.block_k]
        )
    else:
        w_desc = TensorDescriptor.from_tensor(w13.view(e * two_i, h), [tile.block_n, tile.block_k])
    sorted_ids, expert_ids, ntpp, programs = _tile_walk(align, tiles, tile, inter, num_sms)
    scale_a = a_scale if a_scale is not None else a
    scale_w = w13_scale if w13_scale is not None else a
    scale_o = out_scale if out_scale is not None else out
    a_arg, a_half = a, a
    if a_sorted:
        a_arg, a_half = _sorted_row_descs(a, block_m, tile.block_k, tiles is not None)
    _gate_up_tma_kernel[(programs,)](
        a_arg,
        a_half,
        scale_a,
        w_desc,
        scale_w,
        out,
        scale_o,
        sorted_ids,
        expert_ids,
        ntpp,
        num_slots,
        inter,
        h,
        top_k,
        a.stride(0),
        scale_a.stride(0) if fp8 else 0,
        scale_w.stride(0) if fp8 else 0,
        scale_w.stride(1) if fp8 else 0,
        out.stride(0),
        scale_o.stride(0) if fp8 else 0,
        float(limit or 0.0),
        DEFAULT_EPS,
        SCALE_BLOCK=scale_block,
        FP8=fp8,
        ACTIVATION=act,
        HAS_LIMIT=limit is not None,
        BLOCK_M=block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m,
        NUM_PROGRAMS=programs,
        WARP_SPECIALIZE=tile.warp_specialize,
        PAIRED=tile.paired,
        RESCALE=tile.rescale,
        A_SORTED=a_sorted,
        HALF_TILES=tiles is not None,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def launch_down_tma(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    out: torch.Tensor,
    topk_weights: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    num_slots: int,
    block_m: int,
    tile: TmaGemmTile,
    scale_block: int,
    num_sms: int,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``a`` [P, I] sorted (from :func:`launch_gate_up_tma`) -> ``out`` [S, H] by (token, slot)
    row, each row times its top-k weight (fp32 ``topk_weights`` flattened [S]); ``tiles`` as
    for the gate-up."""
    e, h, inter = w2.shape
    fp8 = w2.dtype == FP8_DTYPE
    a_desc, a_half = _sorted_row_descs(a, block_m, tile.block_k, tiles is not None)
    w_desc = TensorDescriptor.from_tensor(w2.view(e * h, inter), [tile.block_n, tile.block_k])
    sorted_ids, expert_ids, ntpp, programs = _tile_walk(align, tiles, tile, h, num_sms)
    scale_a = a_scale if a_scale is not None else a
    scale_w = w2_scale if w2_scale is not None else a
    _down_tma_kernel[(programs,)](
        a_desc,
        a_half,
        scale_a,
        w_desc,
        scale_w,
        out,
        topk_weights,
        sorted_ids,
        expert_ids,
        ntpp,
        num_slots,
        h,
        inter,
        scale_a.stride(0) if fp8 else 0,
        scale_w.stride(0) if fp8 else 0,
        scale_w.stride(1) if fp8 else 0,
        out.stride(0),
        SCALE_BLOCK=scale_block,
        FP8=fp8,
        BLOCK_M=block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m,
        NUM_PROGRAMS=programs,
        WARP_SPECIALIZE=tile.warp_specialize,
        RESCALE=tile.rescale,
        HALF_TILES=tiles is not None,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
