"""One decode token per request through a KV compressor whose state lives in the slot pool (its
entries in the pool's blocks, through the block table), with fixed shapes and no host branch
(CUDA-graph safe).

Each row writes its projected ``kv`` / ``score`` into pending row ``p % ratio`` of its slot. The
entry of the row's block is then computed for *every* row, as if the block were complete, and
written only where it is (``(p + 1) % ratio == 0``): ``where`` keeps the old entry elsewhere, and
the overlap's "previous block" rows advance the same way. The maths is
:meth:`KVCompressor.append`'s for one block (same ops in the same order; both end in
:meth:`KVCompressor.emit`).

Where Triton runs (CUDA, or the interpreter) the step is one fused kernel instead
(:mod:`sglang.kernels.ops.attention.compressor_decode`: one launch, each row pools only when its
block completes); the torch chain below stays the CPU path and the kernel's reference.
"""

from __future__ import annotations

import torch

from sglang.kernels.ops.attention.compressor_decode import compress_decode, compress_decode_reason
from sglang.kernels.ops.triton_dispatch import triton_can_run
from sglang.srt.layers.attention.dsv4_compressor import KVCompressor
from sglang.srt.layers.kv_cache_rows import fp8_format
from sglang.srt.layers.rotary_embedding import InterleavedRotaryEmbedding
from sglang.srt.mem_cache.deepseek_v4_slot_pool import CompressorSlots
from sglang.srt.mem_cache.paged_index import row_address
from sglang.srt.utils.log import get_logger, log_path_once

logger = get_logger(__name__)


def compress_decode_step(
    compressor: KVCompressor,
    store: CompressorSlots,
    kv: torch.Tensor,
    score: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    table: torch.Tensor,
    rotary: InterleavedRotaryEmbedding,
) -> None:
    """``kv`` / ``score [bs, coff*D]`` fp32 of tokens at ``positions [bs]`` of requests in
    ``slots [bs]`` (distinct, except the scratch slot of padding rows) whose blocks ``table``
    lists (each holds the block of its position: the caller reserved it)."""
    if use_decode_kernel(store, kv, score, table, rotary):
        compress_decode(
            kv,
            score,
            positions,
            slots,
            table,
            pending_kv=store.pending_kv,
            pending_score=store.pending_score,
            prev_kv=store.prev_kv,
            prev_score=store.prev_score,
            entries=store.entries,
            maths=compressor.entry_maths(rotary),
            fp8=fp8_format(store.encoding),
        )
        return
    compress_decode_torch(compressor, store, kv, score, positions, slots, table, rotary)


def use_decode_kernel(
    store: CompressorSlots,
    kv: torch.Tensor,
    score: torch.Tensor,
    table: torch.Tensor,
    rotary: InterleavedRotaryEmbedding,
) -> bool:
    """The fused kernel where Triton runs and the shapes fit it (an exact replacement: no flag)."""
    half = rotary.inv_freq.shape[0]
    why = (
        compress_decode_reason(
            kv,
            score,
            store.pending_kv,
            store.prev_kv,
            store.entries,
            table,
            half,
            fp8=fp8_format(store.encoding),
            entry_dtype=store.encoding.dtype,
        )
        if triton_can_run(kv)
        else "Triton cannot run on these tensors"
    )
    log_path_once(logger, "DeepSeek V4 compressor decode step", why)
    return why is None


def compress_decode_torch(
    compressor: KVCompressor,
    store: CompressorSlots,
    kv: torch.Tensor,
    score: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    table: torch.Tensor,
    rotary: InterleavedRotaryEmbedding,
) -> None:
    """The torch path of :func:`compress_decode_step` (the kernel's reference)."""
    ratio, d = compressor.ratio, compressor.dim
    row = positions % ratio
    store.pending_kv[slots, row] = kv.float()
    store.pending_score[slots, row] = score.float()
    complete = (positions + 1) % ratio == 0  # [bs]

    block_kv = store.pending_kv[slots]  # [bs, ratio, width]
    block_score = store.pending_score[slots] + compressor.ape.float()
    if compressor.overlap:
        assert store.prev_kv is not None and store.prev_score is not None
        prev_kv, prev_score = store.prev_kv[slots], store.prev_score[slots]
        cand_kv = torch.cat([prev_kv, block_kv[:, :, d:]], dim=1)
        cand_score = torch.cat([prev_score, block_score[:, :, d:]], dim=1)
        keep = complete[:, None, None]
        store.prev_kv[slots] = torch.where(keep, block_kv[:, :, :d], prev_kv)
        store.prev_score[slots] = torch.where(keep, block_score[:, :, :d], prev_score)
    else:
        cand_kv, cand_score = block_kv, block_score
    block = torch.div(positions, ratio, rounding_mode="floor")
    entry = store.encoding.encode(compressor.emit(cand_kv, cand_score, block, rotary))
    where, offset = row_address(table, slots, block, store.entries.shape[1])
    old = store.entries[where, offset]
    store.entries[where, offset] = torch.where(complete[:, None], entry, old)
