"""DeepSeek V4 attention layer: low-rank q, one shared 512-wide KV head (K = V), sliding window,
attention sinks, per-layer KV compression (ratio 0 / 4 / 128) with the ratio-4 indexer, inverse
RoPE on the output and the grouped low-rank output projection.

Flow for tokens ``x [T, H]`` (already mHC-collapsed and RMS-normed):
  q_lora = q_norm(wq_a(x));  q = wq_b(q_lora) -> [T, heads, D];  q = rms(q) per head (no weight);
  kv = kv_norm(wkv(x)) -> [T, D];  RoPE (interleaved, last rope dims) on q and kv at each position;
  per request: window KV + compressed entries (+ indexer top-k) -> attention with sinks;
  o: inverse RoPE at the query position (V = K carries the rotation), grouped wo_a, then wo_b.
Sliding-only layers use the plain RoPE; compressed layers the compressed (YaRN) RoPE for q, the
window K, their compressed entries and the indexer alike.

Tensor parallel: heads, output groups and sinks are split by rank (``wq_b`` and ``wo_a``
column-parallel, ``wo_b`` row-parallel); the KV head, compressor and indexer are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sglang.kernels.ops.attention.sparse_prefill_attention import sparse_prefill_attention
from sglang.srt.environ import envs
from sglang.srt.layers.attention.dsv4_attention_config import DeepseekV4AttentionConfig
from sglang.srt.layers.attention.dsv4_compressor import KVCompressor
from sglang.srt.layers.attention.dsv4_core import dsv4_attention, prefill_kernel_reason
from sglang.srt.layers.attention.dsv4_indexer import LightningIndexer
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.kv_cache_rows import fp8_format
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    GroupedColumnParallelLinear,
    LinearInput,
    ReplicatedLinear,
    RowParallelLinear,
    dim0_sharded_param,
    per_rank,
)
from sglang.srt.layers.norm_rope import NO_NORM, RowNorm, norm_rope
from sglang.srt.layers.quantization.fp8_linear import rms_norm_quant
from sglang.srt.layers.rotary_embedding import InterleavedRotaryEmbedding
from sglang.srt.mem_cache.deepseek_v4_cache import DeepseekV4LayerCache
from sglang.srt.utils.log import get_logger, log_path_once

logger = get_logger(__name__)


@dataclass(frozen=True)
class _IndexerInputs:
    """The indexer's per-token projections for the whole batch."""

    kv: torch.Tensor
    score: torch.Tensor
    q: torch.Tensor
    w: torch.Tensor


@dataclass(frozen=True)
class Projected:
    """The per-token projections of a forward (shared by the eager and the static decode)."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_lora: LinearInput  # quantised for the FP8 wq_b's when the norm writes FP8
    q: torch.Tensor
    kv: torch.Tensor


@dataclass(frozen=True)
class AttnSegment:
    """One request's rows ``[start, start + length)`` of the batch and its cache for this layer."""

    start: int
    length: int
    cache: DeepseekV4LayerCache


class DeepseekV4Attention(nn.Module):
    def __init__(
        self, config: DeepseekV4AttentionConfig, layer_id: int, spec: LayerBuildSpec
    ) -> None:
        super().__init__()
        c = config
        # Checked before any layer is built so an unsplittable TP size names the heads or groups.
        self.n_local_heads = per_rank(c.num_attention_heads, spec.tp_size, "attention heads")
        self.n_local_groups = per_rank(c.o_groups, spec.tp_size, "output groups")
        self.layer_id = layer_id
        self.kind = c.kind
        self.ratio = c.compress_ratio
        self.head_dim = c.head_dim
        self.o_lora_rank = c.o_lora_rank
        self.window = c.sliding_window
        self.q_head_norm = c.q_head_norm
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim**-0.5
        self.tp_rank, self.tp_size = spec.tp_rank, spec.tp_size
        device = spec.device
        h = c.hidden_size

        # The projections ship as the checkpoint's quantization config says (FP8 in the
        # release); the compressor and the indexer's weights_proj are always float.
        proj = spec.with_dense_quant(c.dense_quant)
        self.wq_a = ReplicatedLinear(h, c.q_lora_rank, proj)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, device=device)
        self.wq_b = ColumnParallelLinear(c.q_lora_rank, c.num_attention_heads * c.head_dim, proj)
        self.wkv = ReplicatedLinear(h, c.head_dim, proj)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps, device=device)
        group_in = c.num_attention_heads * c.head_dim // c.o_groups
        # wo_a is block-diagonal: group g maps its heads' outputs [group_in] to o_lora_rank rows
        # g*R .. g*R+R-1; splitting its rows by rank hands each rank its own groups.
        self.wo_a = GroupedColumnParallelLinear(group_in, c.o_groups, c.o_lora_rank, proj)
        self.wo_b = RowParallelLinear(c.o_groups * c.o_lora_rank, h, proj)
        self.attn_sink = dim0_sharded_param((c.num_attention_heads,), spec)
        self.rotary = InterleavedRotaryEmbedding(c.rope, device=device)

        self.compressor: KVCompressor | None = None
        self.indexer: LightningIndexer | None = None
        if self.kind != "sliding":
            self.compressor = KVCompressor(
                h, c.head_dim, self.ratio, spec, overlap=self.kind == "csa", rms_eps=c.rms_norm_eps
            )
        if self.kind == "csa":
            self.indexer = LightningIndexer(
                spec,
                hidden_size=h,
                q_lora_rank=c.q_lora_rank,
                n_heads=c.index_n_heads,
                head_dim=c.index_head_dim,
                ratio=self.ratio,
                topk=c.index_topk,
                rms_eps=c.rms_norm_eps,
                dense_quant=c.dense_quant,
            )
        # Opt-in (SGLANG_FP8_FUSED_ACT_QUANT): FP8 inputs written by their producers, the q norm
        # (for both wq_b's) and wo_a's epilogue (for wo_b, one 128-column tile per scale).
        fuse = envs.SGLANG_FP8_FUSED_ACT_QUANT.get() and self.wq_a.fp8
        idx_fp8 = self.indexer is None or self.indexer.wq_b.fp8
        self.fuse_q_norm_quant = fuse and self.wq_b.fp8 and idx_fp8
        self.fuse_wo_a_quant = fuse and self.wo_b.fp8 and c.o_lora_rank % 128 == 0

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, segments: list[AttnSegment]
    ) -> torch.Tensor:
        """``x [T, H]`` of a batch of requests (``segments`` cover ``0..T`` in order) -> ``[T, H]``
        (summed over the TP group). Appends the new tokens to each request's cache."""
        p = self.project(x, positions)
        q, kv = p.q, p.kv

        # Everything that is per token runs on the whole batch; only the cache walk is per request.
        comp = self.compressor.project(x) if self.compressor is not None else None
        idx: _IndexerInputs | None = None
        if self.indexer is not None:
            idx = _IndexerInputs(
                *self.indexer.compressor.project(x),
                *self.indexer.queries(p.q_lora, x, p.cos, p.sin),
            )

        o = torch.empty(
            x.shape[0], self.n_local_heads, self.head_dim, dtype=torch.float32, device=x.device
        )
        for seg in segments:
            rows = slice(seg.start, seg.start + seg.length)
            pos = positions[rows]
            window = seg.cache.window
            win_first = window.first_position
            # The new rows continue the ring, so their first position is its count before the
            # append: a host int, where reading pos[0] would sync with the device.
            q_first = window.total
            win_kv = torch.cat([window.rows(), kv[rows].to(window.buf.dtype)])
            window.append(kv[rows])
            why = prefill_kernel_reason(q, window.buf.dtype)
            log_path_once(logger, "DeepSeek V4 prefill attention", why)
            fast = why is None
            # ``entries``: the stored rows (the model dtype, or FP8 rows: ``encoding``)
            entries, visible = self._compressed_entries(seg.cache, rows, pos, comp, idx, fast)
            encoding = seg.cache.compressor.encoding if seg.cache.compressor else None
            if fast:  # only the keys each query sees; ``visible`` is the indexer's picks or None
                sparse_prefill_attention(
                    q[rows],
                    q_first,
                    win_kv,
                    win_first,
                    self.attn_sink,
                    scale=self.scale,
                    window=self.window,
                    entries=entries,
                    ratio=self.ratio,
                    picks=visible,
                    out=o[rows],
                    entry_fp8=fp8_format(encoding),
                )
            else:
                if entries is not None and encoding is not None:
                    entries = encoding.decode(entries, torch.float32)
                o[rows] = dsv4_attention(
                    q[rows],
                    pos,
                    q_first,
                    win_kv,
                    win_first,
                    entries,
                    visible,
                    self.attn_sink,
                    scale=self.scale,
                    window=self.window,
                )
        return self.output(o, p, x.dtype)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> Projected:
        """The per-token projections: rope'd queries ``[T, local_heads, D]`` and KV ``[T, D]``."""
        cos, sin = self.rotary.cos_sin(positions)
        # Each norm (+ rope) is one fused kernel on the GPU (the torch ops elsewhere); every
        # input is a fresh projection, so the kernel writes over it.
        qn, kn = self.q_norm, self.kv_norm
        xa = self.wq_a.prepare_input(x)  # FP8: quantised once for wq_a and wkv
        q_lora: LinearInput
        if self.fuse_q_norm_quant:  # the normed rows go straight to FP8 for both wq_b's
            q_lora = rms_norm_quant(self.wq_a(xa), qn.weight, qn.eps)
        else:
            q_lora = norm_rope(
                self.wq_a(xa), norm=RowNorm.weighted(qn.weight, qn.eps), reuse_input=True
            )
        q = self.wq_b(q_lora).unflatten(-1, (self.n_local_heads, self.head_dim))
        head_norm = RowNorm.unweighted(self.eps) if self.q_head_norm else NO_NORM
        q = norm_rope(q, cos, sin, norm=head_norm, reuse_input=True)
        kv = norm_rope(
            self.wkv(xa), cos, sin, norm=RowNorm.weighted(kn.weight, kn.eps), reuse_input=True
        )
        return Projected(cos, sin, q_lora, q, kv)

    def output(self, o: torch.Tensor, p: Projected, dtype: torch.dtype) -> torch.Tensor:
        """fp32 attention output ``[T, local_heads, D]`` -> ``[T, H]``: inverse RoPE, grouped wo_a,
        wo_b (reduced over the TP group)."""
        o = norm_rope(o, p.cos, p.sin, inverse=True, dtype=dtype)
        grouped = o.reshape(o.shape[0], self.n_local_groups, -1)
        if self.fuse_wo_a_quant:  # wo_a's epilogue writes wo_b's FP8 input
            return self.wo_b(self.wo_a.forward_quantized(grouped))
        return self.wo_b(self.wo_a(grouped))

    def _compressed_entries(
        self,
        cache: DeepseekV4LayerCache,
        rows: slice,
        pos: torch.Tensor,
        comp: tuple[torch.Tensor, torch.Tensor] | None,
        idx: _IndexerInputs | None,
        as_picks: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Feed one request's new tokens to its compressor(s); return all its compressed entries
        as stored ``[N, width]`` (``cache.compressor.encoding``) and which of them each new query
        attends ``[n, N]`` (``None`` when the layer does not compress). ``as_picks`` (the
        kernel's form): the indexer's picks ``[n, k]`` instead, and None for ratio 128 (query
        ``p`` sees entries ``< (p + 1) // ratio``)."""
        if self.compressor is None or comp is None:
            return None, None
        if cache.compressor is None:
            raise RuntimeError(f"layer {self.layer_id}: the request cache has no compressor state")
        self.compressor.append(cache.compressor, comp[0][rows], comp[1][rows], self.rotary)
        entries = cache.compressor.entries.rows()
        if (self.indexer is None or idx is None) and as_picks:
            return entries, None
        if self.indexer is None or idx is None:
            # ratio 128: every complete block is visible, (p + 1) // ratio of them
            count = (pos + 1) // self.ratio
            return entries, torch.arange(entries.shape[0], device=pos.device)[None, :] < count[
                :, None
            ]
        if cache.indexer is None:
            raise RuntimeError(f"layer {self.layer_id}: the request cache has no indexer state")
        self.indexer.compressor.append(cache.indexer, idx.kv[rows], idx.score[rows], self.rotary)
        keys = cache.indexer.entries.rows()
        key_fp8 = fp8_format(cache.indexer.encoding)
        if as_picks:
            return entries, self.indexer.pick(idx.q[rows], idx.w[rows], keys, pos, key_fp8)
        return entries, self.indexer.select(idx.q[rows], idx.w[rows], keys, pos, key_fp8)
