"""Length-aware scores of DeepSeek V4's lightning indexer at decode: one query token per request
against only its visible indexer keys, read in place from the slot pool.

``score[b, n] = sum_h w[b, h] * relu(q[b, h] . keys[slots[b], n]) * scale`` for the request's
visible entries ``n < visible[b]``, ``-inf`` for the rest of the ``C`` columns (so a stable sort
of a row puts the visible entries first, exactly as the torch scoring does). Blocks past the
visible count only write ``-inf``; nothing is gathered into a copy. Keys are per slot
(``[S, C, d]``) or paged (the shared block store, read through the slot's block table), in q's
dtype or as FP8 rows (``--kv-cache-dtype fp8_e4m3``), dequantised in the tile into bf16 values.
bf16 operands, fp32 accumulation (the products are exact; only the summation order differs from
fp32 torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.fit.footprint import Footprint
from sglang.kernels.fit.limits import DeviceLimits
from sglang.kernels.ops.interp_dot import dot
from sglang.kernels.ops.quant.fp8_rows import (
    Fp8RowFormat,
    fp8_constexprs,
    fp8_rows_reason,
    load_rows,
)
from sglang.kernels.ops.triton_dispatch import interpreter_enabled

_BLOCK_N = 64  # key columns a program scores


@triton.jit
def _scores_kernel(
    q_ptr,
    w_ptr,
    keys_ptr,
    table_ptr,
    slots_ptr,
    visible_ptr,
    out_ptr,
    n_cols,
    key_slot_stride,
    table_stride,
    rows_per_block,
    heads,
    scale,
    HEADS_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    DOT_F32: tl.constexpr,
    FP8: tl.constexpr,
    FP8_F: tl.constexpr,
    FP8_ROPE: tl.constexpr,
    FP8_ROPE_OFF: tl.constexpr,
    FP8_SCALE_OFF: tl.constexpr,
    FP8_G: tl.constexpr,
    FP8_NG: tl.constexpr,
    FP8_SCALES: tl.constexpr,
    FP8_ROW: tl.constexpr,
):
    b = tl.program_id(0)
    nb = tl.program_id(1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    vis = tl.load(visible_ptr + b)
    score = tl.full([BLOCK_N], float("-inf"), tl.float32)
    if nb * BLOCK_N < vis:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        h = tl.arange(0, HEADS_PAD)
        h_ok = h < heads  # padded to 16 rows at least (the dot's smallest M)
        cols = tl.arange(0, D)
        q = tl.load(
            q_ptr + (b * heads + h)[:, None] * D + cols[None, :], mask=h_ok[:, None], other=0.0
        )  # [HEADS_PAD, D]
        live = n < vis
        n64 = n.to(tl.int64)
        if FP8:
            row_len = FP8_ROW
        else:
            row_len = D
        if PAGED:  # key n lives in block table[slot, n // R] at row n % R
            blk = tl.load(
                table_ptr + slot * table_stride + n64 // rows_per_block, mask=live, other=0
            )
            off = blk.to(tl.int64) * key_slot_stride + (n64 % rows_per_block) * row_len
        else:
            off = slot * key_slot_stride + n64 * row_len
        if FP8:  # dequantised keys are bf16 values: exact in q's dtype
            k = load_rows(
                keys_ptr, off, live, 0, D, FP8_F, FP8_ROPE, FP8_ROPE_OFF, FP8_SCALE_OFF, FP8_G
            ).to(q.dtype)
        else:
            k = tl.load(keys_ptr + off[:, None] + cols[None, :], mask=live[:, None], other=0.0)
        dots = tl.maximum(dot(q, tl.trans(k), None, DOT_F32), 0.0) * scale  # [HEADS, BLOCK_N]
        w = tl.load(w_ptr + b * heads + h, mask=h_ok, other=0.0)
        score = tl.where(live, tl.sum(dots * w[:, None], axis=0), float("-inf"))
    tl.store(out_ptr + b * n_cols + n, score, mask=n < n_cols)


def scores_footprint(heads: int, head_dim: int) -> Footprint:
    """One program: the padded heads' queries and a ``_BLOCK_N``-key tile (bf16) staged for the
    dot (sm_90 compiler: ``(HEADS_PAD + BLOCK_N) * D * 2``)."""
    heads_pad = max(16, triton.next_power_of_2(heads))
    return Footprint((heads_pad + _BLOCK_N) * head_dim * 2, 4)


def indexer_unfit_reason(heads: int, head_dim: int, limits: DeviceLimits | None) -> str | None:
    """None when the scores kernel takes ``heads`` heads of ``head_dim`` here (the family on, a
    program within the device's limits), else why not."""
    return unfit_reason("indexer", scores_footprint(heads, head_dim), limits)


def indexer_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    slots: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    table: torch.Tensor | None = None,
    key_fp8: Fp8RowFormat | None = None,
) -> torch.Tensor:
    """``q [bs, heads, d]`` (bf16), fp32 head weights ``w [bs, heads]``, the pool's indexer keys
    ``[S, C, d]``, ``slots`` / ``visible [bs]`` -> fp32 ``[bs, C]``. ``key_fp8``: the keys are FP8
    rows of that format (``[S, C, row_bytes]`` uint8), dequantised as they are read.

    Paged keys: with the block table ``table [S, max_blocks]`` (int64), ``keys`` is the block
    store ``[num_blocks + 1, R, d]``, key ``n`` of slot ``s`` is ``keys[table[s, n // R], n % R]``
    and ``C = max_blocks * R``."""
    bs, heads, d = q.shape
    paged = table is not None
    if paged and (table.dtype != torch.int64 or table.stride(1) != 1):
        raise ValueError("the block table must be contiguous int64 rows")
    n_cols = keys.shape[1] * (table.shape[1] if paged else 1)
    out = torch.empty(bs, n_cols, dtype=torch.float32, device=q.device)
    if bs == 0 or n_cols == 0:
        return out
    if key_fp8 is not None:
        why = fp8_rows_reason(keys, key_fp8)
        if why is not None or key_fp8.dim != d:
            raise ValueError(why or f"FP8 keys of {key_fp8.dim} values for head dim {d}")
    elif keys.stride(1) != d or keys.stride(2) != 1:
        raise ValueError("indexer keys must be contiguous rows")
    block_n = _BLOCK_N if key_fp8 is None else 32  # FP8: the dequantisation spilled at 64
    _scores_kernel[(bs, triton.cdiv(n_cols, block_n))](
        q.contiguous(),
        w.float().contiguous(),
        keys,
        table if table is not None else slots,
        slots,
        visible,
        out,
        n_cols,
        keys.stride(0),
        table.stride(0) if table is not None else 0,
        keys.shape[1],
        heads,
        float(scale),
        HEADS_PAD=max(16, triton.next_power_of_2(heads)),
        D=d,
        BLOCK_N=block_n,
        PAGED=paged,
        DOT_F32=interpreter_enabled(),
        **fp8_constexprs(key_fp8),
        num_warps=4,
    )
    return out
