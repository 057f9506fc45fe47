"""Multi-head latent attention without RoPE (Kimi Linear / K3's full-attention layers), with K3's
sigmoid output gate, over a per-request latent KV cache.

For normed input ``x [T, hidden]``:
  q = q_b(q_a_layernorm(q_a(x)))  (or q_proj(x))               [T, h, nope + rope]
  c_kv | k_pe = kv_a_proj_with_mqa(x);  c_kv = kv_a_layernorm(c_kv)
  cache <- [c_kv | k_pe]                                       one row a token, shared by all heads
                                  (model dtype, or FP8 rows: --kv-cache-dtype; read back as cached)
  k_nope | v = kv_b(c_kv) per head;  k = [k_nope | k_pe]       (k_pe unrotated: NoPE)
  o = causal softmax(q k^T * (nope + rope)^-1/2) v            [T, h * v_dim]
  o = o * sigmoid(g_proj(x))  (the sigmoid rounded to the activation dtype, as K3's kernel does)
  out = o_proj(o)
Only KDA layers carry position information; these layers see positions only through causality.

Two equal forms: a multi-token segment expands the cached latents to per-head K/V (cheap when
many queries share them); a single-token segment (decode) absorbs ``kv_b`` into the query and the
output (``w_kc``/``w_vc``) and attends in the 512-wide latent space directly. All single-token
segments of a forward attend together in one padded batch (:mod:`mla_absorbed_batch`, bounded in
padded rows), or, on paged bf16/fp16 (or FP8) latents where Triton runs, in one flash-decoding
kernel that reads the latents in place (``decode_kernel = False`` keeps the torch pass);
``batched_decode = False`` runs them one by one, the reference the tests compare to.

Tensor parallel: heads split by rank (``q_b``/``q_proj``, ``kv_b``, ``g_proj`` column-parallel;
``o_proj`` row-parallel and reducing); ``q_a``, ``kv_a`` and their norms are replicated, so every
rank caches the same latent rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from sglang.srt.layers.attention.mla_absorbed_batch import (
    DEFAULT_MAX_PADDED_ROWS,
    absorbed_decode,
    absorbed_decode_paged,
    decode_chunks,
    decode_kernel_unavailable,
    gather_latents,
    paged_latents,
)
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    per_rank,
)
from sglang.srt.mem_cache.kimi_k3_cache import MLALatentCache
from sglang.srt.mem_cache.paged_rows import PagedRows, append_one_each
from sglang.srt.utils.log import get_logger, log_path_once

logger = get_logger(__name__)


# The prefill attention's SDPA kernels on a GPU, in order of preference; never cuDNN, which
# plans per shape (``causal_prefill_attention``).
_PREFILL_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def causal_prefill_attention(q: Tensor, k: Tensor, v: Tensor, prefix: int, scale: float) -> Tensor:
    """``q [1, h, n, qk]`` at positions ``prefix ..`` over ``k [1, h, S, qk]``, ``v [1, h, S, v]``
    (``S = prefix + n``): query i sees keys ``0 .. prefix + i``, causal aligned to the bottom
    right. SDPA's fused kernels take only 4-D inputs (3-D ones fall back to the math path, which
    materialises every score) and skip the blocks above the diagonal only for a causal form, not
    a boolean mask (``scripts/bench_mla_prefill.py``)."""
    n, s = q.shape[-2], k.shape[-2]
    causal = {"is_causal": True} if prefix == 0 else {"attn_mask": causal_lower_right(n, s)}
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, **causal)
    # Flash attention, v zero-padded to the q/k width it needs: cuDNN's kernel is faster once
    # planned but builds a plan per new prompt length (~65 ms on the H200).
    width, v_dim = q.shape[-1], v.shape[-1]
    v_in = F.pad(v, (0, width - v_dim)) if v_dim < width else v
    with sdpa_kernel(_PREFILL_BACKENDS):
        o = F.scaled_dot_product_attention(q, k, v_in, scale=scale, **causal)
    return o[..., :v_dim]


@dataclass(frozen=True)
class MLANoPEConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    output_gate: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MLASegment:
    """Rows ``[start, start + length)`` are the request's next tokens; ``cache`` holds its
    earlier latent rows (and gets these appended)."""

    start: int
    length: int
    cache: MLALatentCache


class MLANoPEAttention(nn.Module):
    def __init__(self, config: MLANoPEConfig, spec: LayerBuildSpec) -> None:
        super().__init__()
        c = config
        self.config = c
        self.local_heads = per_rank(c.num_heads, spec.tp_size, "MLA heads")
        self.scale = c.qk_head_dim**-0.5
        device = spec.device
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ReplicatedLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if c.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(c.hidden_size, c.num_heads * c.qk_head_dim, spec)
        else:
            self.q_a_proj = ReplicatedLinear(c.hidden_size, c.q_lora_rank, spec)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, device=device)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, c.num_heads * c.qk_head_dim, spec)
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, spec
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, device=device)
        self.kv_b_proj = ColumnParallelLinear(
            c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), spec
        )
        self.g_proj = (
            ColumnParallelLinear(c.hidden_size, c.num_heads * c.v_head_dim, spec)
            if c.output_gate
            else None
        )
        self.o_proj = RowParallelLinear(c.num_heads * c.v_head_dim, c.hidden_size, spec)
        # Decode rows attend in one padded batch of at most ``max_padded_rows`` rows per group.
        self.batched_decode = True
        self.max_padded_rows = DEFAULT_MAX_PADDED_ROWS
        # Paged bf16/fp16 latents where Triton runs: the batched rows in one kernel launch.
        self.decode_kernel = True

    def queries(self, x: Tensor) -> Tensor:
        """``q [T, h, nope + rope]`` of this rank's heads."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert (
                self.q_a_proj is not None
                and self.q_a_layernorm is not None
                and self.q_b_proj is not None
            )
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.local_heads, self.config.qk_head_dim)

    def latents(self, x: Tensor) -> Tensor:
        """The cache rows of ``x``: ``[T, kv_lora_rank + rope]`` = normed ``c_kv`` | raw
        ``k_pe``."""
        c = self.config
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(ckv), k_pe], dim=-1)

    def _kv_b_per_head(self) -> tuple[Tensor, Tensor]:
        """``w_kc [h, nope, L]`` and ``w_vc [h, v, L]``: this rank's ``kv_b`` split per head."""
        c = self.config
        w = self.kv_b_proj.weight.view(
            self.local_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank
        )
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def forward(self, x: Tensor, segments: Sequence[MLASegment]) -> Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]`` (reduced over the TP group); appends each
        segment's latent rows to its cache."""
        t = x.shape[0]
        if sum(s.length for s in segments) != t:
            raise ValueError(f"MLA segments cover {sum(s.length for s in segments)} rows of {t}")
        c = self.config
        q = self.queries(x)
        latent = self.latents(x)
        out = torch.zeros(t, self.local_heads, c.v_head_dim, dtype=x.dtype, device=x.device)
        # The fp32 absorbed weights are the same for every decode segment of this forward: build
        # them once here rather than copying the whole local kv_b per request, and only when
        # some segment actually decodes.
        absorbed: tuple[Tensor, Tensor] | None = None
        if any(seg.length == 1 for seg in segments):
            w_kc, w_vc = self._kv_b_per_head()
            absorbed = (w_kc.float(), w_vc.float())
        batched: list[MLASegment] = []
        for seg in segments:
            if seg.length == 0:
                continue
            if seg.length == 1 and self.batched_decode:
                batched.append(seg)  # appends and attends below, with every other decode row
                continue
            rows = slice(seg.start, seg.start + seg.length)
            prefix = len(seg.cache)
            seg.cache.append(latent[rows])
            # read back as cached (FP8 rows decode exactly into the model dtype)
            kv = seg.cache.values(latent.dtype)
            if seg.length == 1:
                assert absorbed is not None
                out[rows] = self._attend_absorbed(q[rows], kv, *absorbed)
            else:
                out[rows] = self._attend_expanded(q[rows], kv, prefix)
        if batched:
            assert absorbed is not None
            _append_decode_latents(latent, batched)
            self._attend_absorbed_batched(q, out, batched, *absorbed)
        return self.finish(x, out)

    def absorbed_weights(self) -> tuple[Tensor, Tensor]:
        """``w_kc [h, nope, L]`` and ``w_vc [h, v, L]`` in fp32, for the absorbed decode."""
        w_kc, w_vc = self._kv_b_per_head()
        return w_kc.float(), w_vc.float()

    def finish(self, x: Tensor, out: Tensor) -> Tensor:
        """The attention output ``out [T, h, v]`` (``x``'s dtype) through the output gate and
        ``o_proj``."""
        o = out.reshape(x.shape[0], self.local_heads * self.config.v_head_dim)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x).float()).to(o.dtype)
        return self.o_proj(o)

    def _attend_expanded(self, q: Tensor, kv: Tensor, prefix: int) -> Tensor:
        """``q [n, h, qk]`` for positions ``prefix ..``, over ``kv [S, L + rope]`` ->
        ``[n, h, v]``."""
        c = self.config
        s = kv.shape[0]
        ckv, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kvb = self.kv_b_proj(ckv).view(s, self.local_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kvb.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat(
            [k_nope, k_pe.unsqueeze(1).expand(s, self.local_heads, c.qk_rope_head_dim)], dim=-1
        )
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return causal_prefill_attention(qh, kh, vh, prefix, self.scale)[0].transpose(0, 1)

    def _attend_absorbed(self, q: Tensor, kv: Tensor, w_kc: Tensor, w_vc: Tensor) -> Tensor:
        """One query ``q [1, h, qk]`` over all of ``kv`` in the latent space (fp32 maths);
        ``w_kc``/``w_vc`` are :meth:`_kv_b_per_head` already in fp32 (made once per forward)."""
        c = self.config
        q_nope, q_pe = q[0].float().split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        ckv, k_pe = kv.float().split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        q_lat = torch.einsum("hn,hnl->hl", q_nope, w_kc)
        scores = (q_lat @ ckv.t() + q_pe @ k_pe.t()) * self.scale  # [h, S]
        o_lat = torch.softmax(scores, dim=-1) @ ckv  # [h, L]
        return torch.einsum("hl,hvl->hv", o_lat, w_vc).unsqueeze(0).to(q.dtype)

    def _attend_absorbed_batched(
        self, q: Tensor, out: Tensor, segs: Sequence[MLASegment], w_kc: Tensor, w_vc: Tensor
    ) -> None:
        """Write ``out`` rows of the single-token ``segs`` (their latents already appended): the
        kernel over paged latents in place when it can run, else one padded absorbed pass per
        group of :func:`decode_chunks`, so the fp32 padded batch stays within
        ``max_padded_rows`` rows whatever the batch size and context."""
        rope = self.config.qk_rope_head_dim
        caches = [seg.cache for seg in segs]
        why = (
            decode_kernel_unavailable(caches, rope)
            if self.decode_kernel
            else "the decode kernel is turned off on this layer"
        )
        log_path_once(logger, "Kimi K3 absorbed MLA decode", why)
        if why is None:
            latents = paged_latents(caches)
            assert latents is not None
            idx = torch.tensor([seg.start for seg in segs], dtype=torch.long, device=q.device)
            o = absorbed_decode_paged(
                q.index_select(0, idx), latents, w_kc, w_vc, rope_dim=rope, scale=self.scale
            )
            out.index_copy_(0, idx, o.to(out.dtype))
            return
        lengths = [len(c) for c in caches]
        for group in decode_chunks(lengths, self.max_padded_rows):
            kv, lens = gather_latents([segs[i].cache for i in group])
            idx = torch.tensor([segs[i].start for i in group], dtype=torch.long, device=q.device)
            o = absorbed_decode(
                q.index_select(0, idx),
                kv,
                lens,
                w_kc,
                w_vc,
                rope_dim=rope,
                scale=self.scale,
            )
            out.index_copy_(0, idx, o.to(out.dtype))


def _append_decode_latents(latent: Tensor, segs: Sequence[MLASegment]) -> None:
    """Each single-token segment's latent row onto its cache: one scatter when the caches are
    pages of one store (the slot pool's latents; FP8 rows quantised in the same launch), else one
    append each."""
    views = [seg.cache.rows for seg in segs]
    paged = [v for v in views if isinstance(v, PagedRows)]
    if len(paged) == len(views) and all(v.buf is paged[0].buf for v in paged):
        idx = torch.tensor([seg.start for seg in segs], dtype=torch.long, device=latent.device)
        append_one_each(paged, latent.index_select(0, idx), segs[0].cache.encoding)
        return
    for seg in segs:
        seg.cache.append(latent[seg.start : seg.start + 1])
