"""One decode token per request through a KV compressor whose state lives in the slot pool (its
entries in the pool's blocks, through the block table), with fixed shapes and no host branch
(CUDA-graph safe).

Each row writes its projected ``kv`` / ``score`` into pending row ``p % ratio`` of its slot. The
entry of the row's block is then computed for *every* row, as if the block were complete, and
written only where it is (``(p + 1) % ratio == 0``): ``where`` keeps the old entry elsewhere, and
the overlap's "previous block" rows advance the same way. The maths is
:meth:`KVCompressor.append`'s for one block (same ops in the same order; both end in
:meth:`KVCompressor.emit`).
"""

from __future__ import annotations

import torch

from sglang.srt.layers.attention.dsv4_compressor import KVCompressor
from sglang.srt.layers.rotary_embedding import InterleavedRotaryEmbedding
from sglang.srt.mem_cache.deepseek_v4_slot_pool import CompressorSlots
from sglang.srt.mem_cache.paged_index import row_address


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
    entry = compressor.emit(cand_kv, cand_score, block, rotary, store.entries.dtype)
    where, offset = row_address(table, slots, block, store.entries.shape[1])
    old = store.entries[where, offset]
    store.entries[where, offset] = torch.where(complete[:, None], entry, old)
