"""Length-aware decode attention for DeepSeek V4's static decode: one query token per request over
its live window rows, its chosen compressed entries and a per-head sink, in one softmax.

Per request ``b`` (cache slot ``slots[b]`` at position ``p = positions[b]``):
- window: ring rows ``0 .. min(p + 1, W) - 1`` (row ``r`` holds position ``r`` while ``p < W``,
  and every row is live from then on);
- entries: with ``picks [bs, K]`` the first ``min(K, (p + 1) // ratio)`` picks (the indexer's
  stable top-k puts every visible entry before the invisible ones), else entries
  ``0 .. (p + 1) // ratio - 1``;
- the sink: an extra logit per head whose value row is zero.
K = V (one shared KV head). Only those rows are read; nothing is gathered into a copy. Entries
are per slot (``[S, C, D]``) or paged (the shared block store, read through the slot's block
table: only the blocks holding the read entries are touched), in the ring's dtype or as FP8 rows
(``--kv-cache-dtype fp8_e4m3``: ``quant/fp8_rows.py``), dequantised in the key tile; the
dequantised values are bf16 values, so the products stay exact.

Flash-decoding in two launches, both with shapes fixed by the batch (CUDA-graph safe; lengths
are read from device memory): the split kernel walks a slice of the request's key list for ``G``
heads at a time (``tl.dot`` over bf16 keys, fp32 accumulation; the fp32 probabilities enter the
value product as three bf16 parts, which hold all 24 bits, so the result is the fp32 torch
path's up to summation order: 2.5-3.1e-7 per layer on the H200 with gathered rows; the
block-table read has run on the CPU interpreter only), the combine kernel merges the slices
and the sink. Slices past the live length exit after writing their max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.fit.footprint import Footprint
from sglang.kernels.fit.limits import DeviceLimits
from sglang.kernels.ops.attention.online_softmax import (
    EMPTY,
    kernel_head_dim_ok,
    online_softmax_step,
    slice_weight,
)
from sglang.kernels.ops.quant.fp8_rows import (
    Fp8RowFormat,
    fp8_constexprs,
    fp8_rows_reason,
    load_rows,
)
from sglang.kernels.ops.split_plan import split_blocks

_TARGET_PROGRAMS = 264  # two waves of the H200's 132 SMs


@triton.jit
def _split_kernel(
    q_ptr,
    ring_ptr,
    ent_ptr,
    picks_ptr,
    table_ptr,
    slots_ptr,
    pos_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    heads,
    window,
    ring_slot_stride,
    ent_slot_stride,
    table_stride,
    rows_per_block,
    n_picks,
    picks_stride,
    ratio,
    keys_per_split,
    n_splits,
    scale,
    D: tl.constexpr,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ENTRIES: tl.constexpr,
    INDEXED: tl.constexpr,
    PAGED: tl.constexpr,
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
    hg = tl.program_id(1)
    sp = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p = tl.load(pos_ptr + b).to(tl.int64)
    n_win = tl.minimum(p + 1, window)
    n_ent = 0
    if HAS_ENTRIES:
        n_ent = (p + 1) // ratio
        if INDEXED:
            n_ent = tl.minimum(n_ent, n_picks)
    n_total = n_win + n_ent
    start = sp * keys_per_split
    end = tl.minimum(start + keys_per_split, n_total)
    h = hg * G + tl.arange(0, G)
    h_ok = h < heads  # fewer heads than G: the tile is padded (a dot needs 16 rows)
    cols = tl.arange(0, D)
    row = (b * heads + h) * n_splits + sp  # [G] partial rows
    m = tl.full([G], EMPTY, tl.float32)
    if start < end:
        q = tl.load(
            q_ptr + (b * heads + h)[:, None] * D + cols[None, :], mask=h_ok[:, None], other=0.0
        )  # [G, D]
        l_sum = tl.zeros([G], tl.float32)
        acc = tl.zeros([G, D], tl.float32)
        ring_base = ring_ptr + slot * ring_slot_stride
        table_row = table_ptr + slot * table_stride  # paged: the slot's block table
        for j0 in range(start, end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            live = j < end
            in_win = live & (j < n_win)
            in_ent = live & (j >= n_win)
            e = (j - n_win).to(tl.int64)
            if INDEXED:
                e = tl.load(picks_ptr + b * picks_stride + e, mask=in_ent, other=0).to(tl.int64)
            k = tl.load(
                ring_base + j.to(tl.int64)[:, None] * D + cols[None, :],
                mask=in_win[:, None],
                other=0.0,
            )
            if HAS_ENTRIES:
                if FP8:
                    row_len = FP8_ROW
                else:
                    row_len = D
                if PAGED:  # entry e lives in block table[slot, e // R] at row e % R
                    blk = tl.load(table_row + e // rows_per_block, mask=in_ent, other=0)
                    off = blk.to(tl.int64) * ent_slot_stride + (e % rows_per_block) * row_len
                else:
                    off = slot * ent_slot_stride + e * row_len
                if FP8:  # dequantised rows are bf16 values: exact in the key tile
                    k += load_rows(
                        ent_ptr, off, in_ent, 0, D,
                        FP8_F, FP8_ROPE, FP8_ROPE_OFF, FP8_SCALE_OFF, FP8_G,
                    ).to(k.dtype)  # fmt: skip
                else:
                    k += tl.load(
                        ent_ptr + off[:, None] + cols[None, :], mask=in_ent[:, None], other=0.0
                    )
            s = tl.dot(q, tl.trans(k)) * scale  # [G, BLOCK_N] fp32
            s = tl.where(live[None, :], s, float("-inf"))
            m_new, alpha, prob, l_sum = online_softmax_step(s, m, l_sum)
            # fp32 probabilities as three bf16 parts (8 + 8 + 8 significant bits: exact), so the
            # value product is the fp32 torch path's; two parts kept 16 bits, a 2.5e-6 error.
            hi = prob.to(k.dtype)
            rest = prob - hi.to(tl.float32)
            mid = rest.to(k.dtype)
            lo = (rest - mid.to(tl.float32)).to(k.dtype)
            acc = acc * alpha[:, None] + tl.dot(hi, k) + tl.dot(mid, k) + tl.dot(lo, k)
            m = m_new
        tl.store(part_l_ptr + row, l_sum, mask=h_ok)
        tl.store(part_o_ptr + row[:, None] * D + cols[None, :], acc, mask=h_ok[:, None])
    tl.store(part_m_ptr + row, m, mask=h_ok)


@triton.jit
def _combine_kernel(
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    sink_ptr,
    out_ptr,
    heads,
    n_splits,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    cols = tl.arange(0, D)
    base = (b * heads + h) * n_splits
    m = tl.load(part_m_ptr + base + s, mask=s < n_splits, other=EMPTY)
    used = m > EMPTY * 0.5
    sink = tl.load(sink_ptr + h).to(tl.float32)
    top = tl.maximum(tl.max(m, axis=0), sink)
    w = slice_weight(m, top)
    lsum = tl.load(part_l_ptr + base + s, mask=used, other=0.0)
    o = tl.load(part_o_ptr + (base + s)[:, None] * D + cols[None, :], mask=used[:, None], other=0.0)
    denom = tl.sum(w * lsum, axis=0) + tl.exp(sink - top)
    tl.store(out_ptr + (b * heads + h) * D + cols, tl.sum(w[:, None] * o, axis=0) / denom)


def decode_footprint(head_dim: int, group: int = 16, block_n: int = 32) -> Footprint:
    """One split program: the ``group`` heads' queries and the key tile (bf16), staged for the
    two dots (sm_90 compiler: ``D * (2G + 4 * block_n) + 3 KiB``)."""
    return Footprint(head_dim * (2 * group + 4 * block_n) + 3072, 4)


def sparse_decode_unfit_reason(head_dim: int, limits: DeviceLimits | None) -> str | None:
    """None when the split kernel runs rows of ``head_dim`` here (a power of two >= 16, the
    family on, a program within the device's limits), else why not."""
    if not kernel_head_dim_ok(head_dim):
        return f"head dim {head_dim} is not a power of two >= 16"
    return unfit_reason("sparse_decode_attention", decode_footprint(head_dim), limits)


def _split_plan(bs: int, head_groups: int, max_keys: int, block_n: int) -> tuple[int, int]:
    """(splits a request's key list is cut into, keys per split): enough programs for two waves,
    no split shorter than one key block."""
    want = triton.cdiv(_TARGET_PROGRAMS, max(bs * head_groups, 1))
    return split_blocks(max_keys, block_n, min(want, 64))


def sparse_decode_attention(
    q: torch.Tensor,
    ring: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    entries: torch.Tensor | None = None,
    ratio: int = 0,
    picks: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    entry_fp8: Fp8RowFormat | None = None,
) -> torch.Tensor:
    """``q [bs, heads, D]`` (bf16) of requests in ``slots [bs]`` at ``positions [bs]``, the pool's
    window ring ``[S, W, D]``, its compressed ``entries [S, C, D]`` (ratio ``ratio``) and, for
    indexed layers, the chosen entry ids ``picks [bs, K]`` best first -> fp32 ``[bs, heads, D]``.
    ``entry_fp8``: the entries are FP8 rows of that format (``[S, C, row_bytes]`` uint8),
    dequantised as they are read (exact in the ring's dtype: bf16 or fp32).

    Paged entries: with the block table ``table [S, max_blocks]`` (int64, on the device),
    ``entries`` is the shared block store ``[num_blocks + 1, R, D]`` and entry ``e`` of slot ``s``
    is ``entries[table[s, e // R], e % R]`` (``C = max_blocks * R``); only the blocks holding the
    read entries are touched."""
    bs, heads, d = q.shape
    out = torch.empty(bs, heads, d, dtype=torch.float32, device=q.device)
    if bs == 0:
        return out
    if not kernel_head_dim_ok(d) or ring.shape[-1] != d:
        raise ValueError(f"head dim {d} must be a power of two >= 16 and match the ring's")
    if ring.stride(2) != 1 or ring.stride(1) != d:
        raise ValueError("the ring must hold contiguous rows")
    if entries is not None and entry_fp8 is not None:
        why = fp8_rows_reason(entries, entry_fp8)
        if why is not None or entry_fp8.dim != d:
            raise ValueError(why or f"FP8 rows of {entry_fp8.dim} values for head dim {d}")
    elif entries is not None and (entries.stride(2) != 1 or entries.stride(1) != d):
        raise ValueError("the entries must be contiguous rows")
    if picks is not None and picks.stride(1) != 1:
        picks = picks.contiguous()
    paged = table is not None
    if paged:
        if entries is None:
            raise ValueError("a block table needs the paged entries it indexes")
        if table.dtype != torch.int64 or table.stride(1) != 1:
            raise ValueError("the block table must be contiguous int64 rows")
    group = 16  # heads a program takes (the dot's smallest M; fewer heads are padded)
    n_groups = triton.cdiv(heads, group)
    # FP8 entries: half the key tile on twice the warps (the dequantisation's temporaries spilled
    # at 32 x 4; ptxas on sm_90: 32 bytes of spills here against the bf16 tile's 636)
    fp8 = entries is not None and entry_fp8 is not None
    block_n, warps = (16, 8) if fp8 else (32, 4)
    window = ring.shape[1]
    has_entries = entries is not None
    indexed = picks is not None
    n_picks = picks.shape[1] if picks is not None else 0
    n_cols = 0 if entries is None else entries.shape[1] * (table.shape[1] if paged else 1)
    n_entry_max = n_picks if indexed else n_cols
    n_splits, per_split = _split_plan(bs, n_groups, window + n_entry_max, block_n)
    part_o = torch.empty(bs * heads * n_splits, d, dtype=torch.float32, device=q.device)
    part_m = torch.empty(bs * heads * n_splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    ent = entries if entries is not None else ring
    q = q.contiguous()
    _split_kernel[(bs, n_groups, n_splits)](
        q,
        ring,
        ent,
        picks if picks is not None else slots,
        table if table is not None else slots,
        slots,
        positions,
        part_o,
        part_m,
        part_l,
        heads,
        window,
        ring.stride(0),
        ent.stride(0),
        table.stride(0) if table is not None else 0,
        ent.shape[1],
        n_picks,
        picks.stride(0) if picks is not None else 0,
        max(ratio, 1),
        per_split,
        n_splits,
        float(scale),
        D=d,
        G=group,
        BLOCK_N=block_n,
        HAS_ENTRIES=has_entries,
        INDEXED=indexed,
        PAGED=paged,
        **fp8_constexprs(entry_fp8 if fp8 else None),
        num_warps=warps,
        num_stages=2,
    )
    _combine_kernel[(bs, heads)](
        part_o,
        part_m,
        part_l,
        sink,
        out,
        heads,
        n_splits,
        D=d,
        SPLITS=max(2, triton.next_power_of_2(n_splits)),
        num_warps=4,
    )
    return out
