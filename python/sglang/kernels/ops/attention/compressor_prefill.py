"""One request's prefill chunk through DeepSeek V4's KV compressor: every block the chunk
completes pooled into its entry in one launch (one program a block).

The chunk's projected ``kv`` / ``score [T, coff*D]`` (fp32, rows may be strided) follow the
state's ``num_pending`` pending rows: together they are rows ``0 .. num_pending + T`` of the
blocks from ``first_block`` on, and ``nb = (num_pending + T) // ratio`` blocks complete. Program
``b`` pools block ``first_block + b`` over its candidates (a per-channel softmax of ``score +
ape`` weighting ``kv``; with overlap the previous block's rows through channels ``[:D]`` -- for
``b = 0`` the state's kept previous block, whose scores already carry ``ape`` -- and the block's
own rows through ``[D:]``), then RMSNorm, RoPE at position ``block * ratio`` and the cast
(``norm_rope_entry``, shared with the decode kernel), and writes row ``b`` of ``out`` (a cast
to the entries' dtype, or an FP8 row quantised in place: ``store_entry``). The maths
is ``KVCompressor.append``'s (max, ``exp``, sum, divide, weighted sum in fp32); only summation
order and Triton's ``exp`` differ.

Reads only: the pending and previous rows are left for the caller to advance after the launch
(``CompressorState.finish_blocks``), so no program reads what another writes. The torch chain
it replaces was two dozen launches a chunk, which at an 8k prompt left the GPU waiting on the
host (``docs/performance.md``).
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
from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat, fp8_constexprs


@triton.jit
def _block_candidates(
    b, ch, src,
    RATIO: tl.constexpr, D: tl.constexpr, W: tl.constexpr, NC: tl.constexpr,
    CHUNK: tl.constexpr, OVERLAP: tl.constexpr,
):  # fmt: skip
    """Block ``b``'s candidates on channels ``ch`` -> ``(kv, score + ape)``, each
    ``[CHUNK, len(ch)]``; past ``NC``: kv 0, score -inf (softmax weight 0). ``src``: the chunk's
    inputs and the state's rows (the kernel's tuple)."""
    (kv_ptr, kv_stride, score_ptr, score_stride, pend_kv_ptr, pend_score_ptr, prev_kv_ptr,
     prev_score_ptr, ape_ptr, num_pending) = src  # fmt: skip
    cand = tl.arange(0, CHUNK).to(tl.int64)
    valid, own, j, col = candidate_rows(cand, ch, NC, RATIO, D, CHUNK, OVERLAP)
    if OVERLAP:  # the first RATIO candidates are the previous block's rows
        blk = tl.where(own, b, b - 1)
        kept = valid & (blk < 0)  # block 0's previous block: the state's kept rows
    else:
        blk = b + cand * 0
        kept = cand < 0
    row = (blk * RATIO + j)[:, None]  # in the pending rows, then the chunk's
    pend = row < num_pending
    new = row - num_pending
    kv_p = tl.where(pend, pend_kv_ptr + row * W + col, kv_ptr + new * kv_stride + col)
    sc_p = tl.where(pend, pend_score_ptr + row * W + col, score_ptr + new * score_stride + col)
    if OVERLAP:
        prev = j[:, None] * D + ch[None, :]
        kv_p = tl.where(kept[:, None], prev_kv_ptr + prev, kv_p)
        sc_p = tl.where(kept[:, None], prev_score_ptr + prev, sc_p)
    return load_candidates(kv_p, sc_p, ape_ptr, j, col, valid, ch, ~kept, D, W)


@triton.jit
def _pooled(
    b, ch, src,
    RATIO: tl.constexpr, D: tl.constexpr, W: tl.constexpr, NC: tl.constexpr,
    CHUNK: tl.constexpr, OVERLAP: tl.constexpr,
):  # fmt: skip
    """``sum_c softmax_c(score)[c] * kv[c]`` of block ``b`` on channels ``ch`` (fp32)."""
    kv, sc = _block_candidates(b, ch, src, RATIO, D, W, NC, CHUNK, OVERLAP)
    return softmax_pool(kv, sc)


@triton.jit
def _prefill_kernel(
    kv_ptr, kv_stride, score_ptr, score_stride, pend_kv_ptr, pend_score_ptr, prev_kv_ptr,
    prev_score_ptr, ape_ptr, norm_w_ptr, inv_freq_ptr, out_ptr, num_pending, first_block, eps,
    rope_factor,
    RATIO: tl.constexpr, D: tl.constexpr, W: tl.constexpr, NC: tl.constexpr,
    CHUNK: tl.constexpr, ROPE_HALF: tl.constexpr, OVERLAP: tl.constexpr,
    FP8: tl.constexpr, FP8_F: tl.constexpr, FP8_ROPE: tl.constexpr, FP8_ROPE_OFF: tl.constexpr,
    FP8_SCALE_OFF: tl.constexpr, FP8_G: tl.constexpr, FP8_NG: tl.constexpr,
    FP8_SCALES: tl.constexpr, FP8_ROW: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, D // 2).to(tl.int64)
    src = (kv_ptr, kv_stride, score_ptr, score_stride, pend_kv_ptr, pend_score_ptr, prev_kv_ptr,
           prev_score_ptr, ape_ptr, num_pending)  # fmt: skip
    # Even and odd channels pooled as separate tiles: each RoPE pair meets in one thread.
    even = _pooled(b, 2 * i, src, RATIO, D, W, NC, CHUNK, OVERLAP)
    odd = _pooled(b, 2 * i + 1, src, RATIO, D, W, NC, CHUNK, OVERLAP)
    block = first_block + b
    out_even, out_odd = norm_rope_entry(
        even, odd, i, block, norm_w_ptr, inv_freq_ptr, eps, rope_factor,
        RATIO, D, ROPE_HALF,
    )  # fmt: skip
    if FP8:
        row = out_ptr + b * FP8_ROW
    else:
        row = out_ptr + b * D
    store_entry(
        row, out_even, out_odd, i,
        FP8, FP8_F, FP8_ROPE, FP8_ROPE_OFF, FP8_SCALE_OFF, FP8_G, FP8_NG, FP8_SCALES,
    )  # fmt: skip


def compress_prefill_reason(
    kv: torch.Tensor, score: torch.Tensor, ratio: int, dim: int, overlap: bool, rope_half: int,
    entry_dtype: torch.dtype, state: tuple[torch.Tensor | None, ...] = (),
    fp8: Fp8RowFormat | None = None,
) -> str | None:  # fmt: skip
    """Why :func:`compress_prefill` cannot take these (None: it can); ``state``: the pending and
    previous-block buffers it would read; ``fp8``: the entries are FP8 rows of that format."""
    for t in state:
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous()):
            return "the kernel takes contiguous fp32 pending and previous-block rows"
    why = entry_input_reason(kv, score, dim, rope_half, entry_dtype, fp8)
    if why is not None:
        return why
    candidates = (2 if overlap else 1) * ratio
    # More candidates (ratio 128) keep the torch path: one program would hold the whole block.
    if triton.next_power_of_2(candidates) * (dim // 2) > TILE_ELEMS:
        return f"{candidates} candidates x {dim // 2} channels do not fit one tile (ratio 4 does)"
    return None


def compress_prefill(
    kv: torch.Tensor,
    score: torch.Tensor,
    *,
    pending_kv: torch.Tensor,
    pending_score: torch.Tensor,
    num_pending: int,
    prev_kv: torch.Tensor | None,
    prev_score: torch.Tensor | None,
    first_block: int,
    maths: EntryMaths,
    entry_dtype: torch.dtype,
    fp8: Fp8RowFormat | None = None,
) -> torch.Tensor:
    """The entries ``[nb, D]`` (``entry_dtype``; with ``fp8`` FP8 rows ``[nb, row_bytes]``
    uint8, quantised in the kernel) of the blocks the chunk ``kv`` / ``score [T, coff*D]``
    completes after ``num_pending`` pending rows (``pending_kv`` / ``pending_score [ratio,
    coff*D]`` fp32, contiguous); with overlap the kept previous block ``prev_kv`` /
    ``prev_score [ratio, D]``; ``maths``: the compressor's ape, RMSNorm and RoPE parameters.
    Nothing in the state is written (see the module docstring)."""
    ratio, width = pending_kv.shape
    d = maths.dim
    overlap = prev_kv is not None
    coff = pooling_width_factor(kv, score, pending_kv, prev_kv, prev_score, d)
    if maths.ape.shape != (ratio, width):
        raise ValueError(
            f"ape {tuple(maths.ape.shape)} does not match the pending rows {(ratio, width)}"
        )
    if not 0 <= num_pending < ratio:
        raise ValueError(f"num_pending must be in [0, {ratio}), got {num_pending}")
    state = (pending_kv, pending_score, prev_kv, prev_score)
    why = compress_prefill_reason(
        kv, score, ratio, d, overlap, maths.rope_half, entry_dtype, state, fp8
    )
    if why is not None:
        raise ValueError(why)
    nb = (num_pending + kv.shape[0]) // ratio
    if fp8 is None:
        out = torch.empty(nb, d, dtype=entry_dtype, device=kv.device)
    else:
        # zeros: the row's pad bytes, which nothing writes, stay defined
        out = torch.zeros(nb, fp8.row_bytes, dtype=torch.uint8, device=kv.device)
    if nb == 0:
        return out
    nc = coff * ratio
    opts = entry_launch_options()
    _prefill_kernel[(nb,)](
        kv, kv.stride(0), score, score.stride(0), pending_kv, pending_score,
        prev_kv if overlap else pending_kv, prev_score if overlap else pending_score,
        *maths.fp32_tensors(), out, num_pending, first_block, float(maths.eps),
        float(maths.rope_factor),
        RATIO=ratio, D=d, W=width, NC=nc, CHUNK=triton.next_power_of_2(nc),
        ROPE_HALF=maths.rope_half, OVERLAP=overlap, **fp8_constexprs(fp8),
        num_warps=entry_warps(d), **opts,
    )  # fmt: skip
    return out
