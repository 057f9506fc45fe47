"""Length-aware top-k of DeepSeek V4's indexer scores at decode: per request, the ``k`` best of its
``visible`` entries, ties to the earlier entry, read from the visible columns only.

The torch path sorts every one of the ``C`` columns of a slot (``C`` = the table's width, the
longest context) with a stable descending sort and keeps the first ``k``. This kernel picks the
same *set* without sorting: one program per request runs a radix select on the scores' sortable
bit patterns (four passes of 8 bits, each a histogram over the visible columns) to find the
``k``-th best score, then writes every entry that beats it and, in entry order, as many of the
entries equal to it as fit. The picks come out in entry order (better ones first, then the tied
ones), not best first: the attention reads them as a set, so only its summation order changes.
Requests with fewer than ``k`` visible entries pick all of them; the rest of their row is 0 (the
attention reads only the first ``min(k, visible)``). Shapes are fixed by the batch and the
lengths are read on the device (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BINS = 256  # one 8-bit digit; bin 256 of the 512-bin histogram takes the non-matching columns


@triton.jit
def _sortable(x):
    """fp32 -> uint32 whose unsigned order is the floats' order (-0.0 counted as +0.0)."""
    bits = (x + 0.0).to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)


@triton.jit
def _topk_kernel(
    scores_ptr,
    visible_ptr,
    out_ptr,
    n_cols,
    score_stride,
    out_stride,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    vis = tl.minimum(tl.load(visible_ptr + b).to(tl.int32), n_cols)
    vis = tl.maximum(vis, 0)
    k_eff = tl.minimum(K, vis)
    row = scores_ptr + b * score_stride
    out_row = out_ptr + b * out_stride
    # Rows with fewer than K visible entries: their tail is 0 (positions the emit never writes).
    pos = tl.arange(0, K_PAD)
    tl.store(out_row + pos, tl.zeros([K_PAD], tl.int64), mask=(pos >= k_eff) & (pos < K))

    prefix = tl.zeros([1], tl.uint32)  # the digits of the k-th best key found so far
    high = tl.zeros([1], tl.uint32)  # which bits of prefix are fixed
    need = tl.zeros([1], tl.int32) + k_eff  # how many of the matching keys are still wanted
    bins = tl.arange(0, 2 * 256)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([2 * 256], tl.int32)
        for c0 in range(0, vis, BLOCK):
            col = c0 + tl.arange(0, BLOCK)
            live = col < vis
            key = _sortable(tl.load(row + col, mask=live, other=0.0))
            match = live & ((key & high) == prefix)
            digit = ((key >> shift) & 255).to(tl.int32)
            hist += tl.histogram(tl.where(match, digit, 256), 2 * 256)
        hist = tl.where(bins < 256, hist, 0)
        # at_least[d] = matching keys whose digit is >= d; the k-th best has the largest digit
        # with at_least[d] >= need.
        at_least = tl.cumsum(hist, 0, reverse=True)
        ok = (at_least >= need) & (bins < 256)
        d = tl.max(tl.where(ok, bins, 0), 0)
        above = tl.sum(tl.where(bins > d, hist, 0), 0)
        need = need - above
        prefix = prefix | (d.to(tl.uint32) << shift)
        high = high | (tl.full([1], 255, tl.uint32) << shift)

    # prefix is now the k-th best key; k_eff - need keys beat it, `need` of its ties are taken.
    taken_above = k_eff - need
    run_gt = tl.zeros([1], tl.int32)
    run_eq = tl.zeros([1], tl.int32)
    for c0 in range(0, vis, BLOCK):
        col = c0 + tl.arange(0, BLOCK)
        live = col < vis
        key = _sortable(tl.load(row + col, mask=live, other=0.0))
        gt = (live & (key > prefix)).to(tl.int32)
        eq = (live & (key == prefix)).to(tl.int32)
        at_gt = run_gt + tl.cumsum(gt, 0) - gt
        at_eq = taken_above + run_eq + tl.cumsum(eq, 0) - eq
        tl.store(out_row + at_gt, col.to(tl.int64), mask=gt != 0)
        tl.store(out_row + at_eq, col.to(tl.int64), mask=(eq != 0) & (at_eq < k_eff))
        run_gt += tl.sum(gt, 0)
        run_eq += tl.sum(eq, 0)


def indexer_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """``scores [bs, C]`` fp32 (columns past ``visible [bs]`` are not read), ``k <= C`` ->
    int64 ``[bs, k]``: each row's ``min(k, visible)`` best entries (ties to the earlier), then
    zeros."""
    bs, n_cols = scores.shape
    if not 0 < k <= n_cols:
        raise ValueError(f"k={k} must be in 1..{n_cols} (the score columns)")
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError("indexer scores must be contiguous fp32 rows")
    out = torch.empty(bs, k, dtype=torch.int64, device=scores.device)
    if bs == 0:
        return out
    _topk_kernel[(bs,)](
        scores,
        visible,
        out,
        n_cols,
        scores.stride(0),
        out.stride(0),
        K=k,
        K_PAD=triton.next_power_of_2(k),
        BLOCK=1024,
        num_warps=4,
    )
    return out
