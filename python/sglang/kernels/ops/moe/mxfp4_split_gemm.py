"""The split GEMM of the MXFP4 W4A16 fused MoE (``Mxfp4MoeConfig.kernel == "split"``): both expert
GEMMs as one weight-streaming kernel for decode sizes.

Each program computes ``W @ A^T`` for one expert's tile of weight rows and one tile of routed rows:
K in tiles of 128, each tile's packed bytes multiplied as two halves, low and high nibbles, against
the matching halves of the activations (``mxfp4_split_operand.py``). What it does differently from
the dot-order kernels (``fused_moe_mxfp4.py``), and why (decode streams weights):
- The dequantised halves are elementwise in the packed bytes, so they feed the MMA from registers
  (``mma.sync`` at these tile shapes); nothing is staged through shared memory.
- Every load is a plain tile load the pipeliner turns into ``cp.async`` stages (``num_stages``):
  weights, activations and the scales, read as one int32 word a row (four UE8M0 bytes; all three
  resident layouts store them so), so nothing in the loop waits on a synchronous load.
- GEMM 1 takes its gate and up rows as one tile (runs of 8 gate rows then the 8 up rows of the
  same columns, which is how the MegaMoE layout stores them) and splits the accumulator in the
  epilogue, so its tiles are as small as GEMM 2's: at batch 1 the grid is
  ``experts x (rows / tile rows)`` programs, several on each SM.

GEMM 1 writes the gated activation in the split order GEMM 2 reads; GEMM 2 scales each routed row
by its top-k weight. Both are exact in the same sense as the dot-order kernels (dequantised bf16
values, fp32 accumulation). Sized by the shapes alone: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.activation import gated_act
from sglang.kernels.ops.interp_dot import dot
from sglang.kernels.ops.moe.fused_moe import _tile_coords, _tile_rows
from sglang.kernels.ops.moe.mxfp4_operand import (
    ASM_ACC_SCALE,
    MXFP4_BLOCK_K,
    hidden_row_tile,
    reorder_hidden_columns,
    store_transposed,
    stored_gate_up_rows,
    stored_scale_rows,
    weighted_by_topk,
)
from sglang.kernels.ops.moe.mxfp4_split_operand import (
    HALF_K,
    split_order_position,
    split_weight_halves,
    to_split_halves,
)

_BK = tl.constexpr(MXFP4_BLOCK_K)
_HALF = tl.constexpr(HALF_K)
_BYTES = tl.constexpr(MXFP4_BLOCK_K // 2)
_ACC_SCALE = tl.constexpr(ASM_ACC_SCALE)
# GEMM 1 tiles interleave gate and up rows in runs of this many (the MegaMoE granule).
GATE_UP_RUN = 8
_RUN = tl.constexpr(GATE_UP_RUN)


@triton.jit
def _weight_rows(pid_n, n_cols, GATE_UP: tl.constexpr, GRANULE: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    # The stored weight row of each tile row. GEMM 1: tile row r = 16j + 8u + w is column
    # pid_n * BLOCK_N + 8j + w, of the gate (u = 0) or the up (u = 1) projection.
    if GATE_UP:
        r = tl.arange(0, 2 * BLOCK_N)
        col = pid_n * BLOCK_N + (r // (2 * _RUN)) * _RUN + r % _RUN
        rows = stored_gate_up_rows(col, (r // _RUN) % 2, n_cols, GRANULE)
    else:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows


# The row counts change with the batch: not specialised on (one compile serves every M).
@triton.jit(do_not_specialize=["num_slots", "num_m_blocks", "a_row_div"])
def _mxfp4_split_gemm_kernel(
    a_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    num_slots,
    num_m_blocks,
    n_cols,  # GEMM 1: I (gate/up pairs); GEMM 2: H
    k_dim,
    a_row_div,  # GEMM 1: top_k (every slot of a token reads its row); GEMM 2: 1
    stride_am,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_om,
    limit,
    GATE_UP: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    A_IN_ORDER: tl.constexpr,
    GATE_UP_GRANULE: tl.constexpr,
    SCALE_UTCCP: tl.constexpr,
    ASM: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    ROWS: tl.constexpr = 2 * BLOCK_N if GATE_UP else BLOCK_N
    pid_m, pid_n = _tile_coords(num_m_blocks, n_cols, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    slot, row_ok = _tile_rows(pid_m, sorted_ids_ptr, num_slots, BLOCK_M)
    a_row = (slot // a_row_div).to(tl.int64)
    rows = _weight_rows(pid_n, n_cols, GATE_UP, GATE_UP_GRANULE, BLOCK_N).to(tl.int64)
    w_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn + tl.arange(0, _BYTES)[None, :]
    s_rows = stored_scale_rows(rows, SCALE_UTCCP)
    s_ptrs = ws_ptr + expert * stride_wse + s_rows * stride_wsn
    if A_IN_ORDER:  # the halves [64, BLOCK_M] as they lie
        a_ptrs = a_ptr + a_row[None, :] * stride_am + tl.arange(0, _HALF)[:, None]
    else:  # the physical tile [BLOCK_M, 128], reordered here
        a_ptrs = a_ptr + a_row[:, None] * stride_am + tl.arange(0, _BK)[None, :]

    acc = tl.zeros((ROWS, BLOCK_M), dtype=tl.float32)
    for _ in range(0, k_dim, _BK):
        words = tl.load(s_ptrs)
        lo, hi = split_weight_halves(tl.load(w_ptrs), words, ROWS, a_ptr.dtype.element_ty, ASM)
        if A_IN_ORDER:
            a_lo = tl.load(a_ptrs, mask=row_ok[None, :], other=0.0)
            a_hi = tl.load(a_ptrs + _HALF, mask=row_ok[None, :], other=0.0)
        else:
            a_lo, a_hi = to_split_halves(tl.load(a_ptrs, mask=row_ok[:, None], other=0.0), BLOCK_M)
            a_lo = tl.trans(a_lo)
            a_hi = tl.trans(a_hi)
        acc = dot(lo, a_lo, acc, DOT_F32)
        acc = dot(hi, a_hi, acc, DOT_F32)
        w_ptrs += _BYTES
        s_ptrs += stride_wsk
        a_ptrs += _BK

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATE_UP:
        if ASM:  # the fast path's weights entered the MMA scaled by 2**-62
            acc = acc * _ACC_SCALE
        # tile rows (j, u, w) -> gate and up [BLOCK_N, BLOCK_M], row 8j + w
        pairs = acc.reshape(ROWS // (2 * _RUN), 2, _RUN, BLOCK_M).permute(0, 2, 3, 1)
        gate, up = tl.split(pairs.reshape(BLOCK_N, BLOCK_M, 2))
        act = gated_act(gate, up, limit, ACTIVATION, HAS_LIMIT)
        # GEMM 2 reads this row in split order
        store_transposed(
            out_ptr, slot.to(tl.int64), split_order_position(cols), row_ok, stride_om, act
        )
    else:
        acc = weighted_by_topk(acc, topk_weights_ptr, slot, row_ok, ASM)
        store_transposed(out_ptr, slot.to(tl.int64), cols, row_ok, stride_om, acc)


@triton.jit
def _split_order_rows_kernel(x_ptr, out_ptr, rows, stride_xm, stride_om, BLOCK_M: tl.constexpr):
    # The hidden states with every 128 columns in the split order (ahead of GEMM 1).
    x, m, offs_k, ok = hidden_row_tile(x_ptr, rows, stride_xm, BLOCK_M)
    tl.store(out_ptr + m * stride_om + split_order_position(offs_k)[None, :], x, mask=ok)


def hidden_in_split_order(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [T, H] with every 128 columns in the split order (one small kernel)."""
    return reorder_hidden_columns(_split_order_rows_kernel, x, out)


def launch_split_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    words: torch.Tensor,
    out: torch.Tensor,
    topk_weights: torch.Tensor | None,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    gate_up: bool,
    num_slots: int,
    n_cols: int,
    k_dim: int,
    top_k: int,
    block_m: int,
    block_n: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    a_in_order: bool,
    granule: int,
    scale_utccp: bool,
    activation: int = 0,
    limit: float | None = None,
    asm: bool,
    dot_f32: bool,
) -> None:
    """One split GEMM: ``gate_up`` (``a`` the hidden states, ``out`` the intermediate in split
    order, ``n_cols`` = I) or down (``a`` the intermediate, ``out`` the weighted expert outputs,
    ``n_cols`` = H). ``w`` uint8 ``[E, N, K/2]``, ``words`` int32 ``[E, N, K/128]`` (any
    strides)."""
    sorted_ids, expert_ids, ntpp = align
    num_m_blocks = expert_ids.shape[0]
    grid = (num_m_blocks * triton.cdiv(n_cols, block_n),)
    _mxfp4_split_gemm_kernel[grid](
        a, w, words, out, topk_weights if topk_weights is not None else a,
        sorted_ids, expert_ids, ntpp, num_slots, num_m_blocks, n_cols, k_dim,
        top_k if gate_up else 1, a.stride(0), w.stride(0), w.stride(1), words.stride(0),
        words.stride(1), words.stride(2), out.stride(0), float(limit or 0.0),
        GATE_UP=gate_up, ACTIVATION=activation, HAS_LIMIT=limit is not None,
        A_IN_ORDER=a_in_order or not gate_up, GATE_UP_GRANULE=granule if gate_up else 0,
        SCALE_UTCCP=scale_utccp, ASM=asm, DOT_F32=dot_f32, BLOCK_M=block_m, BLOCK_N=block_n,
        GROUP_M=group_m, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
