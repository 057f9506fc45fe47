"""The NoPE MLA layer's decode step for the static decode (Kimi K3's slot pool): one token for each
of ``bs`` rows over the paged latents of ``slots``, with fixed shapes and no host sync (a CUDA
graph captures it).

Row ``i`` writes its latent at position ``positions[i]`` of its slot (through the device block
table) and attends over rows ``0 .. positions[i]``: the lengths are ``positions + 1`` on the
device. The same absorbed maths as the eager batched decode (:mod:`mla_absorbed_batch`): on
paged bf16/fp16 latents where Triton runs, the flash-decoding kernel over each slot's whole table
row (slices past a length exit at once); elsewhere the torch pass over every row the tables reach
(the pool's capacity), rows past each length zeroed and masked. Only summation order differs.
Padding rows (the scratch slot, position 0) write and read row 0 of the null block only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sglang.kernels.fit.decide import limits_for
from sglang.kernels.ops.attention.absorbed_mla_decode import absorbed_decode_unfit_reason
from sglang.kernels.ops.triton_dispatch import triton_can_run
from sglang.srt.layers.attention.mla_absorbed_batch import (
    PagedLatents,
    absorbed_decode,
    absorbed_decode_paged,
)
from sglang.srt.layers.attention.mla_nope import MLANoPEAttention
from sglang.srt.layers.kv_cache_rows import fp8_format
from sglang.srt.mem_cache.paged_index import gather_slot_rows, row_address
from sglang.srt.mem_cache.row_codec import PlainRows, RowCodec


def static_kernel_reason(
    attn: MLANoPEAttention, store: Tensor, encoding: RowCodec | None = None
) -> str | None:
    """Why the static step takes the torch pass over these latents (stored as ``encoding``
    says); None: the kernel runs."""
    if not attn.decode_kernel:
        return "the decode kernel is turned off on this layer"
    if not triton_can_run(store):
        return "Triton cannot run on the latents' device"
    rope = attn.config.qk_rope_head_dim
    fp8 = fp8_format(encoding)
    width = store.shape[-1] if fp8 is None else fp8.dim
    return absorbed_decode_unfit_reason(width - rope, rope, store.dtype, limits_for(store), fp8)


def mla_static_decode(
    attn: MLANoPEAttention,
    x: Tensor,
    positions: Tensor,
    slots: Tensor,
    store: Tensor,
    table: Tensor,
    encoding: RowCodec | None = None,
) -> Tensor:
    """``x [bs, hidden]`` -> ``[bs, hidden]``; writes each row's latent into ``store [blocks + 1,
    R, width]`` at ``positions [bs]`` of ``slots [bs]`` through ``table [S, max_blocks]``, as
    ``encoding`` stores it (None: the store's dtype; FP8 rows: quantised and scattered by one
    kernel)."""
    rope = attn.config.qk_rope_head_dim
    q = attn.queries(x)
    block, offset = row_address(table, slots, positions, store.shape[1])
    enc = encoding or PlainRows(store.shape[-1], store.dtype)
    enc.write(store.view(-1, store.shape[-1]), block * store.shape[1] + offset, attn.latents(x))
    lengths = positions + 1
    w_kc, w_vc = attn.absorbed_weights()
    if static_kernel_reason(attn, store, enc) is None:
        tables = table[slots]  # [bs, max_blocks]: slices past a row's length exit at once
        keys = tables.shape[1] * store.shape[1]
        latents = PagedLatents(store, tables, lengths, keys, enc)
        o = absorbed_decode_paged(q, latents, w_kc, w_vc, rope_dim=rope, scale=attn.scale)
        return attn.finish(x, o.to(x.dtype))
    # [bs, max_blocks * R, L + rope], decoded (FP8 rows exactly)
    kv = enc.decode(gather_slot_rows(store, table, slots), torch.float32)
    # Rows past a length may hold a former owner's values or the padding rows' writes: zeroed,
    # so that a non-finite one cannot reach 0 * x.
    valid = torch.arange(kv.shape[1], device=kv.device) < lengths[:, None]
    kv = kv.masked_fill(~valid[..., None], 0.0)
    o = absorbed_decode(q, kv, lengths, w_kc, w_vc, rope_dim=rope, scale=attn.scale)
    return attn.finish(x, o.to(x.dtype))
