"""One decode token per request through DeepSeek V4's KV compressor, fused into one launch (one
program per batch row; no host sync, no data-dependent size: CUDA-graph safe).

Per row ``b`` (request ``slots[b]`` at ``positions[b] = p``):
- the projected ``kv`` / ``score [coff*D]`` (fp32) go to pending row ``p % ratio`` of the slot;
- if the row completes its block (``(p + 1) % ratio == 0``), the block's entry is pooled over
  its candidates (a per-channel softmax of ``score + ape`` weighting ``kv``; with overlap the
  kept previous block's rows through channels ``[:D]``, whose scores already carry ``ape``, and
  this block's rows through ``[D:]``), RMS-normed (fp32 weight), rotated (interleaved RoPE on the
  last ``2 * half`` channels at position ``block * ratio``), cast to the entries' dtype (or
  quantised as an FP8 row, ``--kv-cache-dtype fp8_e4m3``) and written to
  ``entries[table[slot, block // R], block % R]``; with overlap the block's first
  channel halves (scores plus ``ape[:, :D]``) become the slot's previous block.
A row that completes nothing writes only its pending row. The maths is the torch path's
(``KVCompressor.emit``) in fp32: softmax as max, ``exp``, sum, divide, then the weighted sum;
only summation order (and Triton's ``exp``) differs. Padding rows share a scratch slot: their
writes race there, as the torch path's indexed writes do, and nothing reads that slot unmasked.

The row's own new values are read from ``kv`` / ``score`` (not back from the pending row this
program just wrote), so no load depends on this program's stores; the one write-after-read (the
previous block, read as candidates, then replaced) is fenced by a barrier.

Even and odd channels are pooled as separate ``[candidates, D / 2]`` tiles, so each RoPE pair
``(2i, 2i + 1)`` meets in one thread with no reshuffle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.attention.compressor_entry import (
    TILE_ELEMS,
    EntryMaths,
    candidate_rows,
    entry_input_reason,
    entry_launch_options,
    entry_warps,
    load_candidates,
    norm_rope_entry,
    pooling_width_factor,
    softmax_pool,
    store_entry,
)
from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat, fp8_constexprs, fp8_rows_reason


@triton.jit
def _candidates(
    c0, b, slot, r, ch, src,
    RATIO: tl.constexpr, D: tl.constexpr, W: tl.constexpr, NC: tl.constexpr,
    CHUNK: tl.constexpr, OVERLAP: tl.constexpr,
):  # fmt: skip
    """Candidates ``c0 .. c0 + CHUNK`` on channels ``ch`` -> ``(kv, score + ape)``, each
    ``[CHUNK, len(ch)]``; past ``NC``: kv 0, score -inf (softmax weight 0). ``src``: the row's
    inputs and its slot's state (the kernels' tuple)."""
    (kv_ptr, kv_stride, score_ptr, score_stride, pend_kv_ptr, pend_score_ptr, prev_kv_ptr,
     prev_score_ptr, ape_ptr) = src  # fmt: skip
    valid, own, j, col = candidate_rows(c0 + tl.arange(0, CHUNK), ch, NC, RATIO, D, CHUNK, OVERLAP)
    new = (own & (j == r))[:, None]  # this row's own token: from the inputs
    pend = (slot * RATIO + j)[:, None] * W + col
    kv_p = tl.where(new, kv_ptr + b * kv_stride + col, pend_kv_ptr + pend)
    sc_p = tl.where(new, score_ptr + b * score_stride + col, pend_score_ptr + pend)
    if OVERLAP:
        prev = (slot * RATIO + j)[:, None] * D + ch[None, :]
        kv_p = tl.where(own[:, None], kv_p, prev_kv_ptr + prev)
        sc_p = tl.where(own[:, None], sc_p, prev_score_ptr + prev)
    return load_candidates(kv_p, sc_p, ape_ptr, j, col, valid, ch, own, D, W)


@triton.jit
def _pool(
    b, slot, r, ch, src,
    RATIO: tl.constexpr, D: tl.constexpr, W: tl.constexpr, NC: tl.constexpr,
    CHUNK: tl.constexpr, CH: tl.constexpr, OVERLAP: tl.constexpr,
):  # fmt: skip
    """``sum_c softmax_c(score)[c] * kv[c]`` on the ``CH`` channels ``ch`` (fp32)."""
    if NC <= CHUNK:
        kv, sc = _candidates(0, b, slot, r, ch, src, RATIO, D, W, NC, CHUNK, OVERLAP)
        pooled = softmax_pool(kv, sc)
    else:  # max, then the sum of exp, then the weighted sum: three passes over the chunks
        top = tl.full([CH], float("-inf"), tl.float32)
        for c0 in range(0, NC, CHUNK):
            _, sc = _candidates(c0, b, slot, r, ch, src, RATIO, D, W, NC, CHUNK, OVERLAP)
            top = tl.maximum(top, tl.max(sc, axis=0))
        total = tl.zeros([CH], tl.float32)
        for c0 in range(0, NC, CHUNK):
            _, sc = _candidates(c0, b, slot, r, ch, src, RATIO, D, W, NC, CHUNK, OVERLAP)
            total += tl.sum(tl.exp(sc - top[None, :]), axis=0)
        pooled = tl.zeros([CH], tl.float32)
        for c0 in range(0, NC, CHUNK):
            kv, sc = _candidates(c0, b, slot, r, ch, src, RATIO, D, W, NC, CHUNK, OVERLAP)
            prob = tl.exp(sc - top[None, :]) / total[None, :]
            pooled += tl.sum(prob * kv, axis=0)
    return pooled


@triton.jit
def _write_pending(b, slot, r, w, src, RATIO: tl.constexpr, W: tl.constexpr):
    """The row's new ``kv`` / ``score`` on channels ``w`` into pending row ``r`` of its slot."""
    kv_ptr, kv_stride, score_ptr, score_stride, pend_kv_ptr, pend_score_ptr, _, _, _ = src
    row = (slot * RATIO + r) * W + w
    tl.store(pend_kv_ptr + row, tl.load(kv_ptr + b * kv_stride + w))
    tl.store(pend_score_ptr + row, tl.load(score_ptr + b * score_stride + w))


@triton.jit
def _keep_previous(
    b, slot, r, d, src,
    RATIO: tl.constexpr, RATIO_P2: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
):  # fmt: skip
    """Overlap: the completed block's first halves (channels ``d`` of ``[:D]``; scores plus
    ``ape``) become the slot's previous block. Call after this program read the old one."""
    (kv_ptr, kv_stride, score_ptr, score_stride, pend_kv_ptr, pend_score_ptr, prev_kv_ptr,
     prev_score_ptr, ape_ptr) = src  # fmt: skip
    j = tl.arange(0, RATIO_P2).to(tl.int64)
    live = (j < RATIO)[:, None] & (d < D)[None, :]
    new = (j == r)[:, None]
    pend = (slot * RATIO + j)[:, None] * W + d[None, :]
    kv_new = tl.load(kv_ptr + b * kv_stride + d)[None, :]
    sc_new = tl.load(score_ptr + b * score_stride + d)[None, :]
    kv = tl.where(new, kv_new, tl.load(pend_kv_ptr + pend, mask=live, other=0.0))
    sc = tl.where(new, sc_new, tl.load(pend_score_ptr + pend, mask=live, other=0.0))
    sc = sc + tl.load(ape_ptr + j[:, None] * W + d[None, :], mask=live, other=0.0)
    prev = (slot * RATIO + j)[:, None] * D + d[None, :]
    tl.debug_barrier()  # every thread has read the old previous block (the candidates)
    tl.store(prev_kv_ptr + prev, kv, mask=live)
    tl.store(prev_score_ptr + prev, sc, mask=live)


@triton.jit
def _emit(
    even, odd, i, pos, slot, table_ptr, table_stride, norm_w_ptr, inv_freq_ptr, entries_ptr,
    rows_per_block, eps, rope_factor,
    RATIO: tl.constexpr, D: tl.constexpr, ROPE_HALF: tl.constexpr,
    FP8: tl.constexpr, FP8_F: tl.constexpr, FP8_ROPE: tl.constexpr, FP8_ROPE_OFF: tl.constexpr,
    FP8_SCALE_OFF: tl.constexpr, FP8_G: tl.constexpr, FP8_NG: tl.constexpr,
    FP8_SCALES: tl.constexpr, FP8_ROW: tl.constexpr,
):  # fmt: skip
    """RMSNorm, RoPE and the entry write of a pooled row (``even`` / ``odd`` channels ``2i`` /
    ``2i + 1``, fp32): cast to the entries' dtype, or quantised as an FP8 row."""
    block = pos // RATIO
    out_even, out_odd = norm_rope_entry(
        even, odd, i, block, norm_w_ptr, inv_freq_ptr, eps, rope_factor, RATIO, D, ROPE_HALF
    )
    # The entry's address through the block table (paged_index.row_address)
    blk = tl.load(table_ptr + slot * table_stride + block // rows_per_block).to(tl.int64)
    if FP8:
        dst = entries_ptr + (blk * rows_per_block + block % rows_per_block) * FP8_ROW
    else:
        dst = entries_ptr + (blk * rows_per_block + block % rows_per_block) * D
    store_entry(
        dst, out_even, out_odd, i,
        FP8, FP8_F, FP8_ROPE, FP8_ROPE_OFF, FP8_SCALE_OFF, FP8_G, FP8_NG, FP8_SCALES,
    )  # fmt: skip


@triton.jit
def _fused_kernel(
    kv_ptr, kv_stride, score_ptr, score_stride, pos_ptr, slot_ptr, table_ptr, table_stride,
    pend_kv_ptr, pend_score_ptr, prev_kv_ptr, prev_score_ptr, ape_ptr, norm_w_ptr, inv_freq_ptr,
    entries_ptr, rows_per_block, eps, rope_factor,
    RATIO: tl.constexpr, RATIO_P2: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
    NC: tl.constexpr, CHUNK: tl.constexpr, ROPE_HALF: tl.constexpr, OVERLAP: tl.constexpr,
    FP8: tl.constexpr, FP8_F: tl.constexpr, FP8_ROPE: tl.constexpr, FP8_ROPE_OFF: tl.constexpr,
    FP8_SCALE_OFF: tl.constexpr, FP8_G: tl.constexpr, FP8_NG: tl.constexpr,
    FP8_SCALES: tl.constexpr, FP8_ROW: tl.constexpr,
):  # fmt: skip
    """One program a row, the whole step (candidates x D/2 fit one tile: ratio 4)."""
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    r = pos % RATIO
    src = (kv_ptr, kv_stride, score_ptr, score_stride, pend_kv_ptr, pend_score_ptr, prev_kv_ptr,
           prev_score_ptr, ape_ptr)  # fmt: skip
    _write_pending(b, slot, r, tl.arange(0, W), src, RATIO, W)
    if (pos + 1) % RATIO == 0:
        i = tl.arange(0, D // 2).to(tl.int64)
        even = _pool(b, slot, r, 2 * i, src, RATIO, D, W, NC, CHUNK, D // 2, OVERLAP)
        odd = _pool(b, slot, r, 2 * i + 1, src, RATIO, D, W, NC, CHUNK, D // 2, OVERLAP)
        _emit(
            even, odd, i, pos, slot, table_ptr, table_stride, norm_w_ptr, inv_freq_ptr,
            entries_ptr, rows_per_block, eps, rope_factor, RATIO, D, ROPE_HALF,
        FP8, FP8_F, FP8_ROPE, FP8_ROPE_OFF, FP8_SCALE_OFF, FP8_G, FP8_NG, FP8_SCALES, FP8_ROW,
        )  # fmt: skip
        if OVERLAP:
            _keep_previous(b, slot, r, tl.arange(0, D).to(tl.int64), src, RATIO, RATIO_P2, D, W)


@triton.jit
def _pool_split_kernel(
    kv_ptr, kv_stride, score_ptr, score_stride, pos_ptr, slot_ptr, pend_kv_ptr, pend_score_ptr,
    prev_kv_ptr, prev_score_ptr, ape_ptr, pooled_ptr,
    RATIO: tl.constexpr, RATIO_P2: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
    NC: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, SHARE: tl.constexpr,
    OVERLAP: tl.constexpr,
):  # fmt: skip
    """Program (row, channel block): its share of the pending row and, on a completed block,
    the pooled channels into ``pooled [bs, D]`` (many candidates: ratio 128, whose block one
    program would read alone) and its channels of the previous block."""
    b = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    r = pos % RATIO
    src = (kv_ptr, kv_stride, score_ptr, score_stride, pend_kv_ptr, pend_score_ptr, prev_kv_ptr,
           prev_score_ptr, ape_ptr)  # fmt: skip
    w = cb * SHARE + tl.arange(0, SHARE).to(tl.int64)  # SHARE = W / (D / BLOCK_C)
    _write_pending(b, slot, r, w, src, RATIO, W)
    if (pos + 1) % RATIO == 0:
        ch = cb * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
        pooled = _pool(b, slot, r, ch, src, RATIO, D, W, NC, CHUNK, BLOCK_C, OVERLAP)
        tl.store(pooled_ptr + b * D + ch, pooled)
        if OVERLAP:
            _keep_previous(b, slot, r, ch, src, RATIO, RATIO_P2, D, W)


@triton.jit
def _emit_kernel(
    pooled_ptr, pos_ptr, slot_ptr, table_ptr, table_stride, norm_w_ptr, inv_freq_ptr,
    entries_ptr, rows_per_block, eps, rope_factor,
    RATIO: tl.constexpr, D: tl.constexpr, ROPE_HALF: tl.constexpr,
    FP8: tl.constexpr, FP8_F: tl.constexpr, FP8_ROPE: tl.constexpr, FP8_ROPE_OFF: tl.constexpr,
    FP8_SCALE_OFF: tl.constexpr, FP8_G: tl.constexpr, FP8_NG: tl.constexpr,
    FP8_SCALES: tl.constexpr, FP8_ROW: tl.constexpr,
):  # fmt: skip
    """After :func:`_pool_split_kernel`: one program a row, the completed rows' entries."""
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    if (pos + 1) % RATIO == 0:
        slot = tl.load(slot_ptr + b).to(tl.int64)
        i = tl.arange(0, D // 2).to(tl.int64)
        even = tl.load(pooled_ptr + b * D + 2 * i)
        odd = tl.load(pooled_ptr + b * D + 2 * i + 1)
        _emit(
            even, odd, i, pos, slot, table_ptr, table_stride, norm_w_ptr, inv_freq_ptr,
            entries_ptr, rows_per_block, eps, rope_factor, RATIO, D, ROPE_HALF,
        FP8, FP8_F, FP8_ROPE, FP8_ROPE_OFF, FP8_SCALE_OFF, FP8_G, FP8_NG, FP8_SCALES, FP8_ROW,
        )  # fmt: skip


def compress_decode_reason(
    kv: torch.Tensor,
    score: torch.Tensor,
    pending_kv: torch.Tensor,
    prev_kv: torch.Tensor | None,
    entries: torch.Tensor,
    table: torch.Tensor,
    rope_half: int,
    *,
    fp8: Fp8RowFormat | None = None,
    entry_dtype: torch.dtype | None = None,
) -> str | None:
    """Why :func:`compress_decode` cannot take these tensors (None: it can); ``fp8``: the entries
    are FP8 rows of that format (for a model computing in ``entry_dtype``)."""
    if fp8 is None:
        why = entry_input_reason(kv, score, entries.shape[-1], rope_half, entries.dtype)
    else:
        why = fp8_rows_reason(entries, fp8) or entry_input_reason(
            kv, score, fp8.dim, rope_half, entry_dtype or torch.bfloat16, fp8
        )
    if why is not None:
        return why
    if pending_kv.dtype != torch.float32 or not pending_kv.is_contiguous():
        return "the kernel takes contiguous fp32 pending rows"
    if not entries.is_contiguous():
        return "the kernel takes contiguous entries"
    if prev_kv is not None and not prev_kv.is_contiguous():
        return "the kernel takes contiguous previous-block rows"
    if table.stride(-1) != 1:
        return "the kernel takes block-table rows with unit stride"
    return None


def compress_decode(
    kv: torch.Tensor,
    score: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    table: torch.Tensor,
    *,
    pending_kv: torch.Tensor,
    pending_score: torch.Tensor,
    prev_kv: torch.Tensor | None,
    prev_score: torch.Tensor | None,
    entries: torch.Tensor,
    maths: EntryMaths,
    fp8: Fp8RowFormat | None = None,
) -> None:
    """Update the compressor state in place for ``kv`` / ``score [bs, coff*D]`` (fp32; rows may
    be strided, e.g. halves of one projection) of tokens at ``positions [bs]`` of the requests
    in ``slots [bs]``.

    State: ``pending_kv`` / ``pending_score [S, ratio, coff*D]`` fp32; with overlap (``coff`` 2)
    ``prev_kv`` / ``prev_score [S, ratio, D]`` fp32 (both None without); ``entries
    [num_blocks + 1, R, D]`` (or, with ``fp8``, FP8 rows ``[num_blocks + 1, R, row_bytes]``
    uint8, quantised as they are written) read through ``table [S, max_blocks]``; ``maths``:
    the compressor's ape, RMSNorm and RoPE parameters.

    Few candidates (ratio 4) run as one program a row; many (ratio 128: one program would read
    the whole block alone) as programs per row and channel block, then one a row for the norm,
    RoPE and entry write."""
    bs, width = kv.shape
    slots_total, ratio, _ = pending_kv.shape
    d = entries.shape[-1] if fp8 is None else fp8.dim
    overlap = prev_kv is not None
    coff = pooling_width_factor(kv, score, pending_kv, prev_kv, prev_score, d)
    if pending_score.shape != pending_kv.shape or maths.ape.shape != (ratio, width):
        raise ValueError(
            f"pending scores {tuple(pending_score.shape)} / ape {tuple(maths.ape.shape)} do not "
            f"match the pending rows {tuple(pending_kv.shape)}"
        )
    if overlap and (prev_kv.shape != (slots_total, ratio, d) or prev_score.shape != prev_kv.shape):
        raise ValueError(
            f"previous-block rows {tuple(prev_kv.shape)} / {tuple(prev_score.shape)} are not "
            f"{(slots_total, ratio, d)}"
        )
    if positions.shape != (bs,) or slots.shape != (bs,):
        raise ValueError(f"positions / slots must be [{bs}], got {tuple(positions.shape)}")
    half = maths.rope_half
    if maths.dim != d:
        raise ValueError(f"the norm weight has {maths.dim} channels, the entries {d}")
    why = compress_decode_reason(
        kv, score, pending_kv, prev_kv, entries, table, half, fp8=fp8, entry_dtype=kv.dtype
    )
    if why is not None:
        raise ValueError(why)
    if bs == 0:
        return
    nc, nc_p2 = coff * ratio, triton.next_power_of_2(coff * ratio)
    opts = entry_launch_options()
    ape, norm_weight, inv_freq = maths.fp32_tensors()
    state = (
        pending_kv,
        pending_score,
        prev_kv if overlap else pending_kv,  # unread without overlap
        prev_score if overlap else pending_score,
        ape,
    )
    emit_args = (
        table,
        table.stride(0),
        norm_weight,
        inv_freq,
        entries,
        entries.shape[1],
        float(maths.eps),
        float(maths.rope_factor),
    )
    inputs = (kv, kv.stride(0), score, score.stride(0), positions, slots)
    ratio_p2 = triton.next_power_of_2(ratio)
    if nc_p2 * (d // 2) <= TILE_ELEMS:
        _fused_kernel[(bs,)](
            *inputs[:6], *emit_args[:2], *state, *emit_args[2:],
            RATIO=ratio, RATIO_P2=ratio_p2, D=d, W=width, NC=nc, CHUNK=nc_p2, ROPE_HALF=half,
            OVERLAP=overlap, **fp8_constexprs(fp8), num_warps=entry_warps(d), **opts,
        )  # fmt: skip
        return
    block_c = min(d, max(16, TILE_ELEMS // nc_p2))
    chunk = min(nc_p2, TILE_ELEMS // block_c)
    pooled = torch.empty(bs, d, dtype=torch.float32, device=kv.device)
    _pool_split_kernel[(bs, d // block_c)](
        *inputs, *state, pooled,
        RATIO=ratio, RATIO_P2=ratio_p2, D=d, W=width, NC=nc, CHUNK=chunk, BLOCK_C=block_c,
        SHARE=width // (d // block_c), OVERLAP=overlap, num_warps=4, **opts,
    )  # fmt: skip
    _emit_kernel[(bs,)](
        pooled, positions, slots, *emit_args,
        RATIO=ratio, D=d, ROPE_HALF=half, **fp8_constexprs(fp8), num_warps=entry_warps(d),
        **opts,
    )  # fmt: skip
