"""One decode token per request through DeepSeek V4's KV compressor, fused into one launch (one
program per batch row; no host sync, no data-dependent size: CUDA-graph safe).

Per row ``b`` (request ``slots[b]`` at ``positions[b] = p``):
- the projected ``kv`` / ``score [coff*D]`` (fp32) go to pending row ``p % ratio`` of the slot;
- if the row completes its block (``(p + 1) % ratio == 0``), the block's entry is pooled over
  its candidates (a per-channel softmax of ``score + ape`` weighting ``kv``; with overlap the
  kept previous block's rows through channels ``[:D]``, whose scores already carry ``ape``, and
  this block's rows through ``[D:]``), RMS-normed (fp32 weight), rotated (interleaved RoPE on the
  last ``2 * half`` channels at position ``block * ratio``), cast to the entries' dtype and
  written to ``entries[table[slot, block // R], block % R]``; with overlap the block's first
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

from sglang.kernels.ops.triton_dispatch import interpreter_enabled

_TILE_ELEMS = 4096  # candidates x D/2 per tile; larger candidate sets loop over chunks
_ENTRY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _candidates(
    c0,
    b,
    slot,
    r,
    ch,
    kv_ptr,
    score_ptr,
    pend_kv_ptr,
    pend_score_ptr,
    prev_kv_ptr,
    prev_score_ptr,
    ape_ptr,
    RATIO: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    NC: tl.constexpr,
    CHUNK: tl.constexpr,
    OVERLAP: tl.constexpr,
):
    """Candidates ``c0 .. c0 + CHUNK`` on channels ``ch`` -> ``(kv, score + ape)``, each
    ``[CHUNK, len(ch)]``; past ``NC``: kv 0, score -inf (softmax weight 0)."""
    cand = c0 + tl.arange(0, CHUNK)
    valid = cand < NC
    if OVERLAP:  # candidates < RATIO: the previous block; then this block's second halves
        own = valid & (cand >= RATIO)
        j = tl.where(own, cand - RATIO, cand)
        col = tl.where(own, D, 0)[:, None] + ch[None, :]
    else:
        own = valid
        j = cand
        col = tl.zeros([CHUNK], tl.int64)[:, None] + ch[None, :]
    new = (own & (j == r))[:, None]  # this row's own token: from the inputs
    pend = (slot * RATIO + j)[:, None] * W + col
    kv_p = tl.where(new, kv_ptr + b * W + col, pend_kv_ptr + pend)
    sc_p = tl.where(new, score_ptr + b * W + col, pend_score_ptr + pend)
    if OVERLAP:
        prev = (slot * RATIO + j)[:, None] * D + ch[None, :]
        kv_p = tl.where(own[:, None], kv_p, prev_kv_ptr + prev)
        sc_p = tl.where(own[:, None], sc_p, prev_score_ptr + prev)
    m = valid[:, None] & (ch[None, :] < D)
    kv = tl.load(kv_p, mask=m, other=0.0)
    sc = tl.load(sc_p, mask=m, other=float("-inf"))
    # The kept previous rows already carry their ape (added when they were this block's).
    ape = tl.load(ape_ptr + j[:, None] * W + col, mask=m & own[:, None], other=0.0)
    return kv, sc + ape


@triton.jit
def _pool(
    b,
    slot,
    r,
    ch,
    kv_ptr,
    score_ptr,
    pend_kv_ptr,
    pend_score_ptr,
    prev_kv_ptr,
    prev_score_ptr,
    ape_ptr,
    RATIO: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    NC: tl.constexpr,
    CHUNK: tl.constexpr,
    OVERLAP: tl.constexpr,
):
    """``sum_c softmax_c(score)[c] * kv[c]`` on channels ``ch`` (fp32)."""
    if NC <= CHUNK:
        kv, sc = _candidates(
            0, b, slot, r, ch, kv_ptr, score_ptr, pend_kv_ptr, pend_score_ptr,
            prev_kv_ptr, prev_score_ptr, ape_ptr, RATIO, D, W, NC, CHUNK, OVERLAP,
        )  # fmt: skip
        e = tl.exp(sc - tl.max(sc, axis=0)[None, :])
        prob = e / tl.sum(e, axis=0)[None, :]
        pooled = tl.sum(prob * kv, axis=0)
    else:  # max, then the sum of exp, then the weighted sum: three passes over the chunks
        top = tl.full([D // 2], float("-inf"), tl.float32)
        for c0 in range(0, NC, CHUNK):
            _, sc = _candidates(
                c0, b, slot, r, ch, kv_ptr, score_ptr, pend_kv_ptr, pend_score_ptr,
                prev_kv_ptr, prev_score_ptr, ape_ptr, RATIO, D, W, NC, CHUNK, OVERLAP,
            )  # fmt: skip
            top = tl.maximum(top, tl.max(sc, axis=0))
        total = tl.zeros([D // 2], tl.float32)
        for c0 in range(0, NC, CHUNK):
            _, sc = _candidates(
                c0, b, slot, r, ch, kv_ptr, score_ptr, pend_kv_ptr, pend_score_ptr,
                prev_kv_ptr, prev_score_ptr, ape_ptr, RATIO, D, W, NC, CHUNK, OVERLAP,
            )  # fmt: skip
            total += tl.sum(tl.exp(sc - top[None, :]), axis=0)
        pooled = tl.zeros([D // 2], tl.float32)
        for c0 in range(0, NC, CHUNK):
            kv, sc = _candidates(
                c0, b, slot, r, ch, kv_ptr, score_ptr, pend_kv_ptr, pend_score_ptr,
                prev_kv_ptr, prev_score_ptr, ape_ptr, RATIO, D, W, NC, CHUNK, OVERLAP,
            )  # fmt: skip
            prob = tl.exp(sc - top[None, :]) / total[None, :]
            pooled += tl.sum(prob * kv, axis=0)
    return pooled


@triton.jit
def _compress_decode_kernel(
    kv_ptr,
    score_ptr,
    pos_ptr,
    slot_ptr,
    table_ptr,
    table_stride,
    pend_kv_ptr,
    pend_score_ptr,
    prev_kv_ptr,
    prev_score_ptr,
    ape_ptr,
    norm_w_ptr,
    inv_freq_ptr,
    entries_ptr,
    rows_per_block,
    eps,
    rope_factor,
    RATIO: tl.constexpr,
    RATIO_P2: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    NC: tl.constexpr,
    CHUNK: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    OVERLAP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    r = pos % RATIO
    w = tl.arange(0, W)
    row = (slot * RATIO + r) * W + w
    tl.store(pend_kv_ptr + row, tl.load(kv_ptr + b * W + w))
    tl.store(pend_score_ptr + row, tl.load(score_ptr + b * W + w))
    if (pos + 1) % RATIO == 0:
        i = tl.arange(0, D // 2).to(tl.int64)
        even = _pool(
            b, slot, r, 2 * i, kv_ptr, score_ptr, pend_kv_ptr, pend_score_ptr,
            prev_kv_ptr, prev_score_ptr, ape_ptr, RATIO, D, W, NC, CHUNK, OVERLAP,
        )  # fmt: skip
        odd = _pool(
            b, slot, r, 2 * i + 1, kv_ptr, score_ptr, pend_kv_ptr, pend_score_ptr,
            prev_kv_ptr, prev_score_ptr, ape_ptr, RATIO, D, W, NC, CHUNK, OVERLAP,
        )  # fmt: skip
        # RMSNorm: x * rsqrt(mean(x^2) + eps) * weight
        rs = tl.rsqrt((tl.sum(even * even, axis=0) + tl.sum(odd * odd, axis=0)) / D + eps)
        even = even * rs * tl.load(norm_w_ptr + 2 * i)
        odd = odd * rs * tl.load(norm_w_ptr + 2 * i + 1)
        # RoPE on the last ROPE_HALF pairs at the block's first position
        block = pos // RATIO
        k = i - (D // 2 - ROPE_HALF)
        rot = k >= 0
        inv = tl.load(inv_freq_ptr + k, mask=rot, other=0.0)
        freq = (block * RATIO).to(tl.float32) * inv
        c = tl.cos(freq) * rope_factor
        s = tl.sin(freq) * rope_factor
        out_even = tl.where(rot, even * c - odd * s, even)
        out_odd = tl.where(rot, odd * c + even * s, odd)
        # The entry's address through the block table (paged_index.row_address)
        blk = tl.load(table_ptr + slot * table_stride + block // rows_per_block).to(tl.int64)
        dst = entries_ptr + (blk * rows_per_block + block % rows_per_block) * D
        ty = entries_ptr.dtype.element_ty
        tl.store(dst + 2 * i, out_even.to(ty))
        tl.store(dst + 2 * i + 1, out_odd.to(ty))
        if OVERLAP:  # this block's first halves become the previous block
            j = tl.arange(0, RATIO_P2).to(tl.int64)
            d = tl.arange(0, D).to(tl.int64)
            live = (j < RATIO)[:, None] & (d < D)[None, :]
            new = (j == r)[:, None]
            pend = (slot * RATIO + j)[:, None] * W + d[None, :]
            kv_new = tl.load(kv_ptr + b * W + d)[None, :]
            sc_new = tl.load(score_ptr + b * W + d)[None, :]
            kv = tl.where(new, kv_new, tl.load(pend_kv_ptr + pend, mask=live, other=0.0))
            sc = tl.where(new, sc_new, tl.load(pend_score_ptr + pend, mask=live, other=0.0))
            sc = sc + tl.load(ape_ptr + j[:, None] * W + d[None, :], mask=live, other=0.0)
            prev = (slot * RATIO + j)[:, None] * D + d[None, :]
            tl.debug_barrier()  # every thread has read the old previous block (the candidates)
            tl.store(prev_kv_ptr + prev, kv, mask=live)
            tl.store(prev_score_ptr + prev, sc, mask=live)


def compress_decode_reason(
    kv: torch.Tensor,
    pending_kv: torch.Tensor,
    prev_kv: torch.Tensor | None,
    entries: torch.Tensor,
    table: torch.Tensor,
    rope_half: int,
) -> str | None:
    """Why :func:`compress_decode` cannot take these tensors (None: it can)."""
    d = entries.shape[-1]
    if d < 2 or d & (d - 1):
        return f"the kernel needs a power-of-two entry width, got {d}"
    if not 0 < 2 * rope_half <= d:
        return f"rope dims {2 * rope_half} do not fit the entry width {d}"
    if entries.dtype not in _ENTRY_DTYPES:
        return f"the kernel writes fp32/bf16/fp16 entries, not {entries.dtype}"
    if kv.dtype != torch.float32 or pending_kv.dtype != torch.float32:
        return "the kernel takes fp32 projections and pending rows"
    if not (kv.is_contiguous() and pending_kv.is_contiguous() and entries.is_contiguous()):
        return "the kernel takes contiguous projections, pending rows and entries"
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
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    rope_factor: float,
) -> None:
    """Update the compressor state in place for ``kv`` / ``score [bs, coff*D]`` (fp32) of tokens
    at ``positions [bs]`` of the requests in ``slots [bs]``.

    State: ``pending_kv`` / ``pending_score [S, ratio, coff*D]`` fp32; with overlap (``coff`` 2)
    ``prev_kv`` / ``prev_score [S, ratio, D]`` fp32 (both None without); ``entries
    [num_blocks + 1, R, D]`` read through ``table [S, max_blocks]``. Parameters: ``ape [ratio,
    coff*D]``, the RMSNorm ``norm_weight [D]`` and ``eps``, the rotary ``inv_freq [half]`` (the
    last ``2 * half`` channels rotate) and its attention factor."""
    bs, width = kv.shape
    slots_total, ratio, pend_width = pending_kv.shape
    d = entries.shape[-1]
    overlap = prev_kv is not None
    if (prev_score is None) != (prev_kv is None):
        raise ValueError("prev_kv and prev_score come together (overlap) or not at all")
    coff = 2 if overlap else 1
    if width != coff * d or pend_width != width or score.shape != kv.shape:
        raise ValueError(
            f"kv/score {tuple(kv.shape)}/{tuple(score.shape)} and pending rows "
            f"{tuple(pending_kv.shape)} do not match {coff} x entry width {d}"
        )
    if pending_score.shape != pending_kv.shape or ape.shape != (ratio, width):
        raise ValueError(
            f"pending scores {tuple(pending_score.shape)} / ape {tuple(ape.shape)} do not match "
            f"the pending rows {tuple(pending_kv.shape)}"
        )
    if overlap and (prev_kv.shape != (slots_total, ratio, d) or prev_score.shape != prev_kv.shape):
        raise ValueError(
            f"previous-block rows {tuple(prev_kv.shape)} / {tuple(prev_score.shape)} are not "
            f"{(slots_total, ratio, d)}"
        )
    if positions.shape != (bs,) or slots.shape != (bs,):
        raise ValueError(f"positions / slots must be [{bs}], got {tuple(positions.shape)}")
    half = inv_freq.shape[0]
    why = compress_decode_reason(kv, pending_kv, prev_kv, entries, table, half)
    if why is not None:
        raise ValueError(why)
    if bs == 0:
        return
    nc = coff * ratio
    chunk = min(triton.next_power_of_2(nc), max(1, _TILE_ELEMS // (d // 2)))
    # fp-contraction off: the torch path rounds every product (a fused e*c - o*s would not).
    opts = {} if interpreter_enabled() else {"enable_fp_fusion": False}
    _compress_decode_kernel[(bs,)](
        kv,
        score.contiguous(),
        positions,
        slots,
        table,
        table.stride(0),
        pending_kv,
        pending_score,
        prev_kv if overlap else pending_kv,
        prev_score if overlap else pending_score,
        ape.float().contiguous(),
        norm_weight.float().contiguous(),
        inv_freq.float().contiguous(),
        entries,
        entries.shape[1],
        float(eps),
        float(rope_factor),
        RATIO=ratio,
        RATIO_P2=triton.next_power_of_2(ratio),
        D=d,
        W=width,
        NC=nc,
        CHUNK=chunk,
        ROPE_HALF=half,
        OVERLAP=overlap,
        num_warps=4 if d <= 128 else 8,
        **opts,
    )
