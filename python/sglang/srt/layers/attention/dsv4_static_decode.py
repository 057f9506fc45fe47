"""DeepSeek V4 attention for one decode token per request, reading and writing the slot pool with
fixed shapes: no host sync, no data-dependent size (CUDA-graph capturable).

Per row (request ``slots[i]`` at ``positions[i]``; padding rows use the pool's scratch slot;
compressed entries and indexer keys are read and written through the block table ``table``):
- the new KV goes to ring row ``p % W``; the query then sees all ``W`` ring rows, row ``r``
  holding position ``p - ((p - r) mod W)``, valid when that is ``>= 0``;
- compressed layers first feed their compressor(s) (:func:`compress_decode_step`);
  ratio 128 sees every entry ``< (p + 1) // 128``; ratio 4 the indexer's top-k of its visible
  entries, chosen exactly as the eager indexer does (invalid entries at ``-inf``, a stable sort,
  a fixed ``k``, picks past the visible count masked out);
- one softmax over [window rows | chosen entries | sink], as :func:`dsv4_attention`.
The eager path is the reference; only summation order differs.

Compressed entries and indexer keys are stored as the pool's encoding says (the model dtype, or FP8
rows with ``--kv-cache-dtype fp8_e4m3``): the kernels dequantise them as they read them, the torch
path decodes what it gathers (exactly, into the ring's dtype).

On CUDA with a bf16/fp16 pool (unless ``SGLANG_DSV4_LENGTH_AWARE_DECODE=0``), the indexer
scores and the attention run as length-aware Triton kernels (:mod:`sglang.kernels.ops.attention`):
they read only the live window rows, the visible indexer keys and the chosen entries, in place:
the rings by slot, the paged entries and keys through the block table (only the blocks holding
what is read). Elsewhere the torch path below runs (all ring rows and all entries, gathered,
under masks). On the H200 the kernels equal the torch path to ~3e-7 per layer (every step of
the graph test's reused-slot case, and the model-level kernel test); a bf16 model's logits can
still jump on one step when a MoE router's top-k flips at a near-tie
(``scripts/dsv4_kernel_path_diff.py --routing`` shows it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang.kernels.fit.decide import limits_for
from sglang.kernels.ops.attention.indexer_scores import indexer_scores, indexer_unfit_reason
from sglang.kernels.ops.attention.indexer_topk import indexer_topk
from sglang.kernels.ops.attention.sparse_decode_attention import (
    kernel_head_dim_ok,
    sparse_decode_attention,
    sparse_decode_unfit_reason,
)
from sglang.srt.environ import envs
from sglang.srt.layers.attention.dsv4_static_compressor import compress_decode_step
from sglang.srt.layers.kv_cache_rows import fp8_format
from sglang.srt.mem_cache.deepseek_v4_slot_pool import LayerSlots
from sglang.srt.mem_cache.paged_index import gather_slot_rows, row_address
from sglang.srt.utils.log import get_logger, log_path_once

logger = get_logger(__name__)

if TYPE_CHECKING:
    from sglang.srt.layers.attention.dsv4_attention import DeepseekV4Attention, Projected


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [bs, heads, D]`` over ``keys [bs, M, D]`` (K = V) where ``valid [bs, M]``, plus a
    per-head sink logit -> fp32 ``[bs, heads, D]``."""
    bs, heads, _ = q.shape
    kf = keys.float()
    logits = torch.einsum("bhd,bmd->bhm", q.float(), kf) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_logit = sink.float().view(1, heads, 1).expand(bs, heads, 1)
    probs = torch.softmax(torch.cat([logits, sink_logit], dim=-1), dim=-1)
    return torch.einsum("bhm,bmd->bhd", probs[..., : keys.shape[1]], kf)


def static_decode_attention(
    attn: DeepseekV4Attention,
    x: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    store: LayerSlots,
    table: torch.Tensor,
) -> torch.Tensor:
    """``x [bs, H]`` -> ``[bs, H]`` (TP-reduced), updating the slots' caches in place."""
    p = attn.project(x, positions)
    ring = store.window
    width = ring.shape[1]
    ring[slots, positions % width] = p.kv.to(ring.dtype)
    if attn.compressor is not None:
        comp = store.compressor
        assert comp is not None
        compress_decode_step(
            attn.compressor, comp, *attn.compressor.project(x), positions, slots, table, attn.rotary
        )
    if use_sparse_kernels(attn, ring):
        o = _kernel_attention(attn, x, p, positions, slots, store, table)
    else:
        o = _torch_attention(attn, x, p, positions, slots, store, table)
    return attn.output(o, p, x.dtype)


def use_sparse_kernels(attn: DeepseekV4Attention, ring: torch.Tensor) -> bool:
    """The length-aware kernels take half-precision pools (their dots are bf16/fp16 MMAs with
    fp32 accumulation; fp32 operands would run as tf32) with power-of-two row widths on CUDA,
    unless ``SGLANG_DSV4_LENGTH_AWARE_DECODE=0``. Not under the Triton interpreter: its bf16
    ``tl.dot`` is unusable on the CPU (the CPU tests force the kernels on fp32 pools)."""
    why = sparse_kernels_reason(attn, ring)
    log_path_once(logger, "DeepSeek V4 static decode attention and indexer scores", why)
    return why is None


def sparse_kernels_reason(attn: DeepseekV4Attention, ring: torch.Tensor) -> str | None:
    """None when the length-aware decode kernels (attention and indexer scores) take this layer
    and pool here, else why the torch path runs."""
    if not envs.SGLANG_DSV4_LENGTH_AWARE_DECODE.get():
        return "SGLANG_DSV4_LENGTH_AWARE_DECODE=0"
    if not ring.is_cuda:
        return "the pool is not on CUDA"
    if ring.dtype not in (torch.bfloat16, torch.float16):
        return f"the pool is {ring.dtype}, the kernels take bf16/fp16"
    idx_dim = attn.indexer.head_dim if attn.indexer is not None else 16
    if not (kernel_head_dim_ok(attn.head_dim) and kernel_head_dim_ok(idx_dim)):
        return f"head dims {attn.head_dim} / {idx_dim} are not powers of two >= 16"
    limits = limits_for(ring)
    why = sparse_decode_unfit_reason(attn.head_dim, limits)
    if why is None and attn.indexer is not None:
        why = indexer_unfit_reason(attn.indexer.n_heads, idx_dim, limits)
    return why


def _kernel_attention(
    attn: DeepseekV4Attention,
    x: torch.Tensor,
    p: Projected,
    positions: torch.Tensor,
    slots: torch.Tensor,
    store: LayerSlots,
    table: torch.Tensor,
) -> torch.Tensor:
    q = p.q.to(store.window.dtype)
    if attn.compressor is None:
        return sparse_decode_attention(
            q, store.window, slots, positions, attn.attn_sink, attn.scale
        )
    comp = store.compressor
    assert comp is not None
    # Window rings per slot, entries and indexer keys in the block store through ``table``: the
    # kernels read both in place (only the live ring rows and the blocks of the read entries).
    picks = None
    if attn.indexer is not None:
        idx_store = store.indexer
        assert idx_store is not None
        ic = attn.indexer.compressor
        compress_decode_step(ic, idx_store, *ic.project(x), positions, slots, table, attn.rotary)
        iq, iw = attn.indexer.queries(p.q_lora, x, p.cos, p.sin)
        visible = torch.div(positions + 1, attn.ratio, rounding_mode="floor")
        scale = attn.indexer.head_dim**-0.5
        scores = indexer_scores(
            iq.to(q.dtype),
            iw,
            idx_store.entries,
            slots,
            visible,
            scale,
            table=table,
            key_fp8=fp8_format(idx_store.encoding),
        )
        k = min(attn.indexer.topk, scores.shape[1])
        if envs.SGLANG_DSV4_TOPK_KERNEL.get():
            # The stable sort's set (ties to the earlier entry) from the visible columns only,
            # in entry order, which the attention reads as a set.
            picks = indexer_topk(scores, visible, k)
            log_path_once(logger, "DeepSeek V4 indexer top-k", None)
        else:
            # the torch scoring's stable sort: visible entries first, ties to the earlier
            log_path_once(logger, "DeepSeek V4 indexer top-k", "SGLANG_DSV4_TOPK_KERNEL=0")
            picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return sparse_decode_attention(
        q,
        store.window,
        slots,
        positions,
        attn.attn_sink,
        attn.scale,
        entries=comp.entries,
        ratio=attn.ratio,
        picks=picks,
        table=table,
        entry_fp8=fp8_format(comp.encoding),
    )


def _torch_attention(
    attn: DeepseekV4Attention,
    x: torch.Tensor,
    p: Projected,
    positions: torch.Tensor,
    slots: torch.Tensor,
    store: LayerSlots,
    table: torch.Tensor,
) -> torch.Tensor:
    ring = store.window
    width = ring.shape[1]
    rows = torch.arange(width, device=x.device)
    win_pos = positions[:, None] - (positions[:, None] - rows[None, :]) % width
    keys, valid = [ring[slots]], [win_pos >= 0]

    if attn.compressor is not None:
        comp = store.compressor
        assert comp is not None
        visible = torch.div(positions + 1, attn.ratio, rounding_mode="floor")
        if attn.indexer is None:
            # ratio 128: all candidates, decoded into the ring's dtype (FP8 rows exactly)
            entries = comp.encoding.decode(gather_slot_rows(comp.entries, table, slots), ring.dtype)
            ids = torch.arange(entries.shape[1], device=x.device)
            keys.append(entries)
            valid.append(ids[None, :] < visible[:, None])
        else:
            idx_store = store.indexer
            assert idx_store is not None
            ic = attn.indexer.compressor
            compress_decode_step(
                ic, idx_store, *ic.project(x), positions, slots, table, attn.rotary
            )
            iq, iw = attn.indexer.queries(p.q_lora, x, p.cos, p.sin)
            # Fixed k = min(topk, C) picks per row; picks past the visible count are masked out.
            idx_keys = idx_store.encoding.decode(
                gather_slot_rows(idx_store.entries, table, slots), torch.float32
            )
            top, ok = attn.indexer.top_entries(iq, iw, idx_keys, visible)
            block, offset = row_address(table, slots[:, None], top, comp.entries.shape[1])
            keys.append(comp.encoding.decode(comp.entries[block, offset], ring.dtype))
            valid.append(ok.gather(1, top))

    return sink_attention(
        p.q, torch.cat(keys, dim=1), torch.cat(valid, dim=1), attn.attn_sink, attn.scale
    )
