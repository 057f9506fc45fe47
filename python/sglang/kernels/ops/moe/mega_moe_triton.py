"""MegaMoE in Triton: the routed experts in one persistent launch that cannot deadlock.

For ``T`` tokens routed to ``k`` experts each, after the rows are grouped by expert
(``moe_align_block_size``, the pre-dispatch), one launch of ``grid`` CTAs (the MegaMoE SM
budget) computes:

* phase 1 tiles ``(row block, n1)``: gate and up columns ``n1`` of the block's expert, the gated
  activation in the epilogue, written to the intermediate ``inter [T*k, I]``;
* phase 2 tiles ``(row block, n2)``: ``inter @ w2[e].T`` for output columns ``n2``, times the
  row's top-k weight, written to ``down [T*k, H]``; then the top-k combine: every row counts
  itself on ``combined[token, n2]``, and the writer that completes a token's count sums the
  token's ``k`` rows (in slot order, fp32) into ``out[token, n2]``.

Synchronisation without a grid barrier: CTAs claim tiles from one atomic queue in order, phase 1
before phase 2, and a phase-2 tile waits only for its row block's phase-1 tiles. A tile is
claimed only after every earlier tile was claimed by a CTA that is running, and a tile never
waits on a later one, so the launch completes with any number of resident CTAs, even one. A
kernel on another stream holding SMs can slow it but not hang it. Every wait is still bounded by
a deadline and sets a status word the host turns into :class:`MegaMoEWaitTimeout`.

``whole_grid_sync=True`` adds the design this one avoids, a barrier that waits for every CTA of
the grid before any work, so tests can show the bounded-wait error instead of a hang.

FP8 (128x128 block weights): the tokens are quantised per token per 128 values once before the
launch (``per_token_group_quant_fp8``, the pre-dispatch), and the intermediate once per 128-wide
group inside the launch, by the phase-1 tile that completes the group (same formula), so both
GEMMs take e4m3 operands with the same roundings as the two-launch path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.fit.footprint import Footprint, pipelined_dot_shared
from sglang.kernels.fit.limits import DeviceLimits
from sglang.kernels.ops.activation import activation_code, gated_act
from sglang.kernels.ops.gpu_clock import globaltimer_ns
from sglang.kernels.ops.moe.align import moe_align_block_size_triton
from sglang.kernels.ops.moe.fused_moe import (
    _scaled_dot,
    _times_topk_weight,
    _w_scale_ptrs,
    check_moe_inputs,
    resolve_moe_output,
    routing_operands,
)
from sglang.kernels.ops.moe.mega_moe_workspace import (
    BARRIER,
    EXITS,
    QUEUE,
    STATUS_GRID_BARRIER_TIMEOUT,
    STATUS_OK,
    STATUS_TILE_WAIT_TIMEOUT,
    Workspace,
    WorkspaceLayout,
    get_workspace,
)
from sglang.kernels.ops.quant.fp8 import (
    DEFAULT_EPS,
    FP8_DTYPE,
    per_token_group_quant_fp8,
    quant_rows_fp8,
)
from sglang.kernels.ops.triton_dispatch import interpreter_enabled

# A child of the engine's "sglang" logger: its handler prints these lines (kernels set up none).
logger = logging.getLogger(__name__)

# Module constants a kernel reads must be constexpr objects.
_QUEUE = tl.constexpr(QUEUE)
_EXITS = tl.constexpr(EXITS)
_BARRIER = tl.constexpr(BARRIER)
_TILE_TIMEOUT = tl.constexpr(STATUS_TILE_WAIT_TIMEOUT)
_GRID_TIMEOUT = tl.constexpr(STATUS_GRID_BARRIER_TIMEOUT)

_logged_launches: set[tuple[int, MegaMoEConfig]] = set()


class MegaMoEWaitTimeout(RuntimeError):
    """A wait inside the Triton MegaMoE kernel gave up; the launch's output is not valid."""


@dataclass(frozen=True)
class MegaMoEConfig:
    """One tile shape for the whole launch (both phases are compiled into one kernel)."""

    block_m: int  # rows of one expert per tile (the alignment of the sorted rows)
    block_n1: int  # gate columns per phase-1 tile (as many up columns ride along)
    block_n2: int  # output columns per phase-2 tile
    block_k: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int = 1  # CTAs launched per SM of the budget (more loads in flight an SM)


def get_mega_config(num_tokens: int, num_experts: int, top_k: int, fp8: bool) -> MegaMoEConfig:
    """Tiles by the average rows an expert gets (``T*k/E``): decode streams weights, so narrow
    column tiles keep every CTA busy with deep K pipelines; more rows grow the row tile."""
    rows = num_tokens * top_k / max(num_experts, 1)
    # Chosen from scripts/bench_mega_moe.py --sweep on an H200 (docs/performance.md): several
    # CTAs an SM keep enough loads in flight, which one deep pipeline per SM did not.
    if fp8:
        if rows < 0.5:
            return MegaMoEConfig(16, 32, 64, 128, 4, 4, 4)
        if rows <= 16:
            return MegaMoEConfig(16, 32, 128, 128, 4, 5, 3)
        if rows <= 48:
            return MegaMoEConfig(32, 64, 128, 128, 4, 3, 2)
        return MegaMoEConfig(64, 64, 128, 128, 8, 3, 1)
    if rows < 0.5:
        return MegaMoEConfig(16, 32, 64, 128, 4, 3, 3)
    if rows <= 16:
        return MegaMoEConfig(16, 64, 128, 128, 4, 3, 2)
    if rows <= 48:
        return MegaMoEConfig(32, 64, 128, 128, 4, 3, 2)
    return MegaMoEConfig(64, 64, 128, 128, 8, 3, 1)


def fit_config(cfg: MegaMoEConfig, hidden: int, inter: int, fp8: bool) -> MegaMoEConfig:
    """Shrink bf16 tiles (powers of two, down to 16) until they divide small widths, e.g. the
    built-in model's hidden 128 and intermediate 64; FP8 tiles are fixed by its 128x128 blocks."""
    if fp8:
        return cfg

    def fit(block: int, *dims: int) -> int:
        while block > 16 and any(d % block for d in dims):
            block //= 2
        return block

    return replace(
        cfg,
        block_k=fit(cfg.block_k, hidden, inter),
        block_n1=fit(cfg.block_n1, inter),
        block_n2=fit(cfg.block_n2, hidden),
    )


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _wait_at_least(
    count_ptr, want, status_ptr, timeout_ns, STATUS_CODE: tl.constexpr, USE_TIMER: tl.constexpr
):
    # Acquire-poll ``count >= want``; gives up at the deadline or as soon as any CTA has set the
    # status (then every other waiter leaves quickly too). Returns whether the count was reached.
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    failed = tl.load(status_ptr, volatile=True)
    if USE_TIMER:
        start = globaltimer_ns()
        elapsed = start - start
        while (seen < want) & (elapsed < timeout_ns) & (failed == 0):
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
            failed = tl.load(status_ptr, volatile=True)
            elapsed = globaltimer_ns() - start
    else:
        polls = 0  # the interpreter runs CTAs one after another: a poll stands for a millisecond
        while (seen < want) & (polls < timeout_ns // 1000000) & (failed == 0):
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
            failed = tl.load(status_ptr, volatile=True)
            polls += 1
    if seen < want:
        tl.atomic_max(status_ptr, STATUS_CODE)
    return seen >= want


@triton.jit
def _row_block(mb, expert_ids_ptr, sorted_ptr, num_slots, BLOCK_M: tl.constexpr):
    # Row block mb's expert, its routed-row slots and which of them are real (padding >= slots).
    # (fused_moe._tile_rows offsets the rows before the pointer: other code for the same rows.)
    expert = tl.load(expert_ids_ptr + mb).to(tl.int64)
    slot = tl.load(sorted_ptr + mb * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, slot, slot < num_slots


@triton.jit
def _phase1_tile(
    mb,
    n1,
    x_ptr,
    xs_ptr,
    w13_ptr,
    w13s_ptr,
    inter_ptr,
    inters_ptr,
    stage_ptr,
    sorted_ptr,
    expert_ids_ptr,
    num_slots,
    inter_dim,
    k_dim,
    stride_xm,
    stride_xsm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_im,
    stride_ism,
    stride_sm,
    limit,
    eps,
    work_ptr,
    done1_off,
    groups_off,
    TOP_K: tl.constexpr,
    FP8: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N1: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert, slot, row_ok = _row_block(mb, expert_ids_ptr, sorted_ptr, num_slots, BLOCK_M)
    tok = (slot // TOP_K).to(tl.int64)
    offs_n = n1 * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + inter_dim * stride_wn
    gs_ptrs = _w_scale_ptrs(w13s_ptr, expert, offs_n, stride_wse, stride_wsn, SCALE_BLOCK)
    us_ptrs = gs_ptrs + (inter_dim // SCALE_BLOCK) * stride_wsn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N1), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N1), dtype=tl.float32)
    for kb in range(k_dim // BLOCK_K):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        bg = tl.load(g_ptrs)
        bu = tl.load(u_ptrs)
        if FP8:
            # x is already e4m3 with one scale per token per 128 values (pre-dispatch).
            ks = (kb * BLOCK_K) // SCALE_BLOCK
            a_s = tl.load(xs_ptr + tok * stride_xsm + ks, mask=row_ok, other=0.0)
            acc_g = _scaled_dot(acc_g, a, bg, a_s, tl.load(gs_ptrs + ks))
            acc_u = _scaled_dot(acc_u, a, bu, a_s, tl.load(us_ptrs + ks))
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = gated_act(acc_g, acc_u, limit, ACTIVATION, HAS_LIMIT)
    row = slot.to(tl.int64)
    out_ptrs = inter_ptr + row[:, None] * stride_im + offs_n[None, :]
    if FP8:
        # Stage the activation in the model dtype; the tile that completes a 128-wide group
        # quantises it per token (as the two-launch path quantises its stored intermediate), and
        # done1 counts quantised groups.
        tl.store(
            stage_ptr + row[:, None] * stride_sm + offs_n[None, :],
            act.to(stage_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
        tl.debug_barrier()
        group = (n1 * BLOCK_N1) // SCALE_BLOCK
        group_ptr = work_ptr + groups_off + mb * (inter_dim // SCALE_BLOCK) + group
        before = tl.atomic_add(group_ptr, 1, sem="acq_rel", scope="gpu")
        if before == SCALE_BLOCK // BLOCK_N1 - 1:
            tl.debug_barrier()
            cols = group * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
            staged = tl.load(
                stage_ptr + row[:, None] * stride_sm + cols[None, :],
                mask=row_ok[:, None],
                other=0.0,
                cache_modifier=".cg",  # other CTAs wrote parts of the group during this launch
            )
            # The same quantiser as the pre-dispatch's per_token_group_quant_fp8.
            q, scale = quant_rows_fp8(staged.to(tl.float32), eps)
            tl.store(
                inter_ptr + row[:, None] * stride_im + cols[None, :],
                q.to(inter_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )
            tl.store(inters_ptr + row * stride_ism + group, scale, mask=row_ok)
            tl.debug_barrier()
            tl.atomic_add(work_ptr + done1_off + mb, 1, sem="release", scope="gpu")
    else:
        tl.store(out_ptrs, act.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None])
        # Every thread's stores happen before the release that publishes them to other CTAs.
        tl.debug_barrier()
        tl.atomic_add(work_ptr + done1_off + mb, 1, sem="release", scope="gpu")


@triton.jit
def _phase2_tile(
    mb,
    n2,
    inter_ptr,
    inters_ptr,
    w2_ptr,
    w2s_ptr,
    down_ptr,
    out_ptr,
    topk_w_ptr,
    topk_ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    num_slots,
    num_experts,
    done1_target,
    n2_tiles,
    k_dim,
    stride_im,
    stride_ism,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_dm,
    stride_om,
    work_ptr,
    done1_off,
    combined_off,
    status_ptr,
    timeout_ns,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N2: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_TIMER: tl.constexpr,
):
    ready = _wait_at_least(
        work_ptr + done1_off + mb, done1_target, status_ptr, timeout_ns, _TILE_TIMEOUT, USE_TIMER
    )
    tl.debug_barrier()
    if ready:
        expert, slot, row_ok = _row_block(mb, expert_ids_ptr, sorted_ptr, num_slots, BLOCK_M)
        row = slot.to(tl.int64)
        offs_n = n2 * BLOCK_N2 + tl.arange(0, BLOCK_N2)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = inter_ptr + row[:, None] * stride_im + offs_k[None, :]
        w_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        ws_ptrs = _w_scale_ptrs(w2s_ptr, expert, offs_n, stride_wse, stride_wsn, SCALE_BLOCK)
        acc = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)
        for kb in range(k_dim // BLOCK_K):
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
            if FP8:
                ks = (kb * BLOCK_K) // SCALE_BLOCK
                a_s = tl.load(inters_ptr + row * stride_ism + ks, mask=row_ok, other=0.0)
                acc = _scaled_dot(acc, a, w, a_s, tl.load(ws_ptrs + ks))
            else:
                acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        val = _times_topk_weight(acc, topk_w_ptr, row, row_ok).to(down_ptr.dtype.element_ty)
        tl.store(down_ptr + row[:, None] * stride_dm + offs_n[None, :], val, mask=row_ok[:, None])
        tl.debug_barrier()

        # Combine: the row that completes its token's count for these columns sums the token.
        tok = (slot // TOP_K).to(tl.int64)
        ks = tl.arange(0, TOP_K_PAD)
        ids = tl.load(
            topk_ids_ptr + tok[:, None] * TOP_K + ks[None, :],
            mask=row_ok[:, None] & (ks[None, :] < TOP_K),
            other=-1,
        )
        expected = tl.sum(((ids >= 0) & (ids < num_experts)).to(tl.int32), axis=1)
        cnt_ptrs = work_ptr + combined_off + tok * n2_tiles + n2
        before = tl.atomic_add(cnt_ptrs, 1, mask=row_ok, sem="acq_rel", scope="gpu")
        last = row_ok & (before == expected - 1)
        tl.debug_barrier()
        total = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)
        for s in tl.static_range(TOP_K):
            e = tl.load(topk_ids_ptr + tok * TOP_K + s, mask=last, other=-1)
            take = last & (e >= 0) & (e < num_experts)
            v = tl.load(
                down_ptr + (tok * TOP_K + s)[:, None] * stride_dm + offs_n[None, :],
                mask=take[:, None],
                other=0.0,
                cache_modifier=".cg",  # written by other CTAs during this launch: skip L1
            )
            total += v.to(tl.float32)
        tl.store(
            out_ptr + tok[:, None] * stride_om + offs_n[None, :],
            total.to(out_ptr.dtype.element_ty),
            mask=last[:, None],
        )
        tl.store(cnt_ptrs, tl.zeros((BLOCK_M,), dtype=tl.int32), mask=last)


@triton.jit
def _zero_unrouted_rows(
    out_ptr,
    topk_ids_ptr,
    num_tokens,
    num_experts,
    hidden,
    stride_om,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    BLOCK_Z: tl.constexpr,
):
    # Tokens whose every slot is masked (-1) get no phase-2 row, so nothing would combine them.
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    ks = tl.arange(0, TOP_K_PAD)
    cols = tl.arange(0, BLOCK_Z)
    for t in range(pid, num_tokens, grid):
        ids = tl.load(topk_ids_ptr + t * TOP_K + ks, mask=ks < TOP_K, other=-1)
        routed = tl.sum(((ids >= 0) & (ids < num_experts)).to(tl.int32), axis=0)
        if routed == 0:
            for c in range(0, hidden, BLOCK_Z):
                ptrs = out_ptr + t * stride_om + c + cols
                tl.store(
                    ptrs,
                    tl.zeros((BLOCK_Z,), dtype=out_ptr.dtype.element_ty),
                    mask=c + cols < hidden,
                )


@triton.jit(do_not_specialize=["timeout_ns"])
def _mega_moe_kernel(
    x_ptr,
    xs_ptr,
    w13_ptr,
    w13s_ptr,
    w2_ptr,
    w2s_ptr,
    out_ptr,
    inter_ptr,
    inters_ptr,
    stage_ptr,
    down_ptr,
    topk_w_ptr,
    topk_ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    work_ptr,
    status_ptr,
    num_tokens,
    num_experts,
    hidden,
    inter_dim,
    stride_xm,
    stride_xsm,
    stride_w13e,
    stride_w13n,
    stride_w13se,
    stride_w13sn,
    stride_w2e,
    stride_w2n,
    stride_w2se,
    stride_w2sn,
    stride_om,
    stride_im,
    stride_ism,
    stride_sm,
    stride_dm,
    done1_off,
    groups_off,
    combined_off,
    limit,
    eps,
    timeout_ns,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    FP8: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N1: tl.constexpr,
    BLOCK_N2: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_TIMER: tl.constexpr,
    WHOLE_GRID_SYNC: tl.constexpr,
):
    grid = tl.num_programs(0)
    num_slots = num_tokens * TOP_K
    go = True
    if WHOLE_GRID_SYNC:
        tl.atomic_add(work_ptr + _BARRIER, 1, sem="release", scope="gpu")
        go = _wait_at_least(
            work_ptr + _BARRIER, grid, status_ptr, timeout_ns, _GRID_TIMEOUT, USE_TIMER
        )
    if go:
        _zero_unrouted_rows(
            out_ptr, topk_ids_ptr, num_tokens, num_experts, hidden, stride_om, TOP_K, TOP_K_PAD, 256
        )
        num_m_blocks = tl.load(ntpp_ptr) // BLOCK_M
        n1_tiles = inter_dim // BLOCK_N1
        n2_tiles = hidden // BLOCK_N2
        # What a row block's phase-2 tiles wait for: its phase-1 tiles, or with FP8 its
        # quantised 128-wide groups.
        done1_target = inter_dim // SCALE_BLOCK if FP8 else n1_tiles
        phase1 = num_m_blocks * n1_tiles
        total = phase1 + num_m_blocks * n2_tiles
        tile = tl.atomic_add(work_ptr + _QUEUE, 1, sem="relaxed", scope="gpu")
        while tile < total:
            if tile < phase1:
                _phase1_tile(
                    tile // n1_tiles,
                    tile % n1_tiles,
                    x_ptr,
                    xs_ptr,
                    w13_ptr,
                    w13s_ptr,
                    inter_ptr,
                    inters_ptr,
                    stage_ptr,
                    sorted_ptr,
                    expert_ids_ptr,
                    num_slots,
                    inter_dim,
                    hidden,
                    stride_xm,
                    stride_xsm,
                    stride_w13e,
                    stride_w13n,
                    stride_w13se,
                    stride_w13sn,
                    stride_im,
                    stride_ism,
                    stride_sm,
                    limit,
                    eps,
                    work_ptr,
                    done1_off,
                    groups_off,
                    TOP_K,
                    FP8,
                    ACTIVATION,
                    HAS_LIMIT,
                    SCALE_BLOCK,
                    BLOCK_M,
                    BLOCK_N1,
                    BLOCK_K,
                )
            else:
                t2 = tile - phase1
                _phase2_tile(
                    t2 // n2_tiles,
                    t2 % n2_tiles,
                    inter_ptr,
                    inters_ptr,
                    w2_ptr,
                    w2s_ptr,
                    down_ptr,
                    out_ptr,
                    topk_w_ptr,
                    topk_ids_ptr,
                    sorted_ptr,
                    expert_ids_ptr,
                    num_slots,
                    num_experts,
                    done1_target,
                    n2_tiles,
                    inter_dim,
                    stride_im,
                    stride_ism,
                    stride_w2e,
                    stride_w2n,
                    stride_w2se,
                    stride_w2sn,
                    stride_dm,
                    stride_om,
                    work_ptr,
                    done1_off,
                    combined_off,
                    status_ptr,
                    timeout_ns,
                    TOP_K,
                    TOP_K_PAD,
                    FP8,
                    SCALE_BLOCK,
                    BLOCK_M,
                    BLOCK_N2,
                    BLOCK_K,
                    USE_TIMER,
                )
            tile = tl.atomic_add(work_ptr + _QUEUE, 1, sem="relaxed", scope="gpu")
    # The last CTA out re-arms the queue and the block counters: every other CTA has made its
    # final claim and finished its tiles by now. (Clearing them here, not per block, keeps
    # atomics off the tiles' critical path.)
    exits = tl.atomic_add(work_ptr + _EXITS, 1, sem="acq_rel", scope="gpu")
    if exits == grid - 1:
        zeros = tl.zeros((1024,), dtype=tl.int32)
        for start in range(done1_off, combined_off, 1024):
            offs = start + tl.arange(0, 1024)
            tl.store(work_ptr + offs, zeros, mask=offs < combined_off)
        tl.atomic_xchg(work_ptr + _QUEUE, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(work_ptr + _BARRIER, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(work_ptr + _EXITS, 0, sem="relaxed", scope="gpu")


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


@dataclass
class MegaMoELaunch:
    """What one launch used, for the status check (and tests)."""

    grid: int
    workspace: Workspace
    timeout_ms: float
    compiled: Any = None  # Triton's compiled kernel (registers and shared memory, for occupancy)

    def check(self) -> None:
        """Synchronise and raise :class:`MegaMoEWaitTimeout` if a wait gave up."""
        raise_if_timed_out(self.workspace, self.grid, self.timeout_ms)


def raise_if_timed_out(ws: Workspace, grid: int, timeout_ms: float) -> None:
    status = int(ws.status.item())
    if status == STATUS_OK:
        return
    ws.clear()  # a launch that gave up may leave counters set
    what = (
        "the whole-grid barrier (whole_grid_sync) did not see every CTA resident"
        if status == STATUS_GRID_BARRIER_TIMEOUT
        else "a phase-2 tile waited for its phase-1 tiles"
    )
    raise MegaMoEWaitTimeout(
        f"Triton MegaMoE: {what} for more than {timeout_ms:g} ms on a grid of {grid} CTAs (the "
        f"MegaMoE SM budget, set by SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS). Another stream "
        "is holding SMs; raise SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS, or the wait timeout "
        "SGLANG_MEGA_MOE_WAIT_TIMEOUT_MS if the GPU is just slow. The output of this call is "
        "invalid."
    )


def mega_fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_sms: int,
    activation: str = "swiglu",
    swiglu_limit: float | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | list[int] | None = None,
    out: torch.Tensor | None = None,
    config: MegaMoEConfig | None = None,
    timeout_ms: float = 1000.0,
    whole_grid_sync: bool = False,
    grid: int | None = None,
    launch_info: list[MegaMoELaunch] | None = None,
) -> torch.Tensor:
    """Routed experts in one persistent launch of ``num_sms * config.ctas_per_sm`` CTAs (``grid``
    overrides the count, for tests); the same maths, arguments and
    output contract as :func:`sglang.kernels.ops.moe.fused_moe.fused_experts` (non-in-place:
    ``out`` when given, else a new tensor; only intermediates are allocated here).

    The launch is asynchronous: a wait that gave up is reported by the status word, which
    :func:`raise_if_timed_out` (or ``launch_info[-1].check()``) reads. Shapes must tile evenly:
    ``I % block_n1``, ``H % block_n2`` and both ``% block_k``; FP8 needs 128x128 blocks."""
    code = activation_code(activation, swiglu_limit)
    p = check_moe_inputs(
        hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape, out
    )
    result = resolve_moe_output(hidden, False, out)
    cfg = config or fit_config(
        get_mega_config(p.tokens, p.num_experts, p.top_k, p.fp8), p.hidden, p.inter, p.fp8
    )
    problem = unsupported_reason(p.hidden, p.inter, p.fp8, p.block, cfg)
    if problem is not None:
        raise ValueError(f"Triton MegaMoE cannot take this shape: {problem}")
    if num_sms < 1:
        raise ValueError(f"num_sms must be >= 1, got {num_sms}")
    if p.tokens == 0:
        return result
    for t in (hidden, w13, w2, w13_scale, w2_scale):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(
                "Triton MegaMoE needs the last dimension of hidden, weights and scales contiguous"
            )
    ids, weights = routing_operands(topk_ids, topk_weights)
    sorted_ids, expert_ids, ntpp = moe_align_block_size_triton(ids, cfg.block_m, p.num_experts)
    num_slots = p.tokens * p.top_k
    dev, dt = hidden.device, hidden.dtype
    x, x_scale = hidden, hidden
    inter = torch.empty((num_slots, p.inter), dtype=FP8_DTYPE if p.fp8 else dt, device=dev)
    inter_scale = stage = inter
    if p.fp8:
        stage = torch.empty((num_slots, p.inter), dtype=dt, device=dev)
        # The pre-dispatch quantisation (DeepGEMM's MegaMoE does the same before its kernel).
        x, x_scale = per_token_group_quant_fp8(hidden, 128)
        inter_scale = torch.empty((num_slots, p.inter // 128), dtype=torch.float32, device=dev)
    down = torch.empty((num_slots, p.hidden), dtype=dt, device=dev)
    layout = WorkspaceLayout(
        expert_ids.shape[0], p.tokens, p.hidden // cfg.block_n2, p.inter // 128 if p.fp8 else 0
    )
    ws = get_workspace(dev, layout.words)
    s13 = w13_scale if p.fp8 else w13
    s2 = w2_scale if p.fp8 else w2
    assert s13 is not None and s2 is not None
    launch_grid = grid if grid is not None else num_sms * cfg.ctas_per_sm
    compiled = _mega_moe_kernel[(launch_grid,)](
        x,
        x_scale,
        w13,
        s13,
        w2,
        s2,
        result,
        inter,
        inter_scale,
        stage,
        down,
        weights,
        ids,
        sorted_ids,
        expert_ids,
        ntpp,
        ws.counters,
        ws.status,
        p.tokens,
        p.num_experts,
        p.hidden,
        p.inter,
        x.stride(0),
        x_scale.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0) if p.fp8 else 0,
        s13.stride(1) if p.fp8 else 0,
        w2.stride(0),
        w2.stride(1),
        s2.stride(0) if p.fp8 else 0,
        s2.stride(1) if p.fp8 else 0,
        result.stride(0),
        inter.stride(0),
        inter_scale.stride(0),
        stage.stride(0),
        down.stride(0),
        layout.done1,
        layout.groups,
        layout.combined,
        float(swiglu_limit or 0.0),
        DEFAULT_EPS,
        int(timeout_ms * 1e6),
        TOP_K=p.top_k,
        TOP_K_PAD=triton.next_power_of_2(p.top_k),
        FP8=p.fp8,
        ACTIVATION=code,
        HAS_LIMIT=swiglu_limit is not None,
        SCALE_BLOCK=p.block[0],
        BLOCK_M=cfg.block_m,
        BLOCK_N1=cfg.block_n1,
        BLOCK_N2=cfg.block_n2,
        BLOCK_K=cfg.block_k,
        USE_TIMER=not interpreter_enabled(),
        WHOLE_GRID_SYNC=whole_grid_sync,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if launch_info is not None:
        launch_info.append(MegaMoELaunch(launch_grid, ws, timeout_ms, compiled))
    if (launch_grid, cfg) not in _logged_launches:  # once per shape, off the per-call path
        _logged_launches.add((launch_grid, cfg))
        logger.info(
            f"Triton MegaMoE: one persistent launch of {launch_grid} CTAs on a {num_sms}-SM budget "
            f"(tiles {cfg})"
        )
    return result


def mega_footprint(
    cfg: MegaMoEConfig, fp8: bool, capability: tuple[int, int] = (9, 0)
) -> Footprint:
    """One CTA: the larger of its two phases' pipelined dots (gate-up: gate and up tiles, twice
    ``block_n1`` columns; down: ``block_n2``), which share their buffers; ``ctas_per_sm`` of them
    resident on one SM."""
    elem = 1 if fp8 else 2
    dots = [
        pipelined_dot_shared(
            block_m=cfg.block_m,
            block_k=cfg.block_k,
            a_bytes=elem,
            b_cols=cols,
            b_bytes=elem,
            num_stages=cfg.num_stages,
            num_warps=cfg.num_warps,
            capability=capability,
        )
        for cols in (2 * cfg.block_n1, cfg.block_n2)
    ]
    return Footprint(max(dots), cfg.num_warps, ctas_per_sm=cfg.ctas_per_sm)


def mega_unfit_reason(cfg: MegaMoEConfig, fp8: bool, limits: DeviceLimits | None) -> str | None:
    """None when ``cfg``'s CTAs fit the device (each, and ``ctas_per_sm`` of them on one SM) and
    the family is on, else why not."""
    cap = limits.capability if limits is not None else (9, 0)
    return unfit_reason(
        "mega_moe_triton", mega_footprint(cfg, fp8, cap), limits, what=f"Triton MegaMoE {cfg}"
    )


def unsupported_reason(
    hidden: int, inter: int, fp8: bool, block: tuple[int, int], cfg: MegaMoEConfig
) -> str | None:
    """Why the kernel cannot take these widths (``None`` when it can)."""
    if inter % cfg.block_n1 or inter % cfg.block_k:
        return f"intermediate size {inter} must be a multiple of {cfg.block_n1} and {cfg.block_k}"
    if hidden % cfg.block_n2 or hidden % cfg.block_k:
        return f"hidden size {hidden} must be a multiple of {cfg.block_n2} and {cfg.block_k}"
    if fp8 and (block != (128, 128) or cfg.block_k != 128 or 128 % cfg.block_n1):
        return (
            "FP8 needs 128x128 weight blocks, block_k 128 and block_n1 dividing 128 (phase-1 "
            "tiles "
            f"make up whole activation groups), got {block}, {cfg.block_k} and {cfg.block_n1}"
        )
    return None


__all__ = [
    "MegaMoEConfig",
    "MegaMoELaunch",
    "MegaMoEWaitTimeout",
    "get_mega_config",
    "mega_footprint",
    "mega_fused_experts",
    "mega_unfit_reason",
    "raise_if_timed_out",
    "unsupported_reason",
]
