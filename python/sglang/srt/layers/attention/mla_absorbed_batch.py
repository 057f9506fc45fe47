"""Batched absorbed decode of the NoPE MLA layer: ``B`` requests with one new token each attend
over their latent rows in one padded pass instead of one small-kernel chain per request.

For queries ``q [B, h, nope + rope]`` and each request's latent rows ``[n_b, L + rope]``:
  q_lat = q_nope w_kc                                     [B, h, L]   (all B at once)
  kv    = the rows padded to ``[B, S, L + rope]``, S = max n_b; rows past n_b zeroed
  s     = (q_lat ckv^T + q_pe k_pe^T) * scale, -inf past n_b;  o_lat = softmax(s) ckv
  o     = o_lat w_vc^T                                    [B, h, v]
The same fp32 maths, in the same order, as the per-request path
(:meth:`MLANoPEAttention._attend_absorbed`), so the two agree to fp32 rounding.

Rows of paged caches that share one store are gathered through their block-table rows in one
indexing op; other caches are padded from their own rows. The padded fp32 batch takes
``B * S * (L + rope) * 4`` bytes, so :func:`decode_chunks` splits the requests into groups of at
most ``max_rows`` padded rows (a request longer than that alone is one group).

FP8 latents (``--kv-cache-dtype fp8_e4m3``) are decoded as they are gathered (exactly). Paged
bf16/fp16 or FP8 latents where Triton runs take the flash-decoding kernel instead
(:func:`absorbed_decode_paged`, ``kernels/ops/attention/absorbed_mla_decode.py``): the same
maths, exact bf16 parts of the fp32 operands, the latents read in place through the block table
(no padded copy, so no groups), the ``w_kc`` / ``w_vc`` absorption as here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sglang.kernels.fit.decide import limits_for
from sglang.kernels.ops.attention.absorbed_mla_decode import (
    absorbed_decode_unfit_reason,
    absorbed_mla_decode,
)
from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat
from sglang.kernels.ops.triton_dispatch import triton_can_run
from sglang.srt.layers.kv_cache_rows import fp8_format
from sglang.srt.mem_cache.kimi_k3_cache import MLALatentCache
from sglang.srt.mem_cache.paged_rows import PagedRows
from sglang.srt.mem_cache.row_codec import RowCodec

# 2^18 padded rows: at K3's 512 + 64 latent that is 0.6 GB of fp32 latents (plus 0.3 GB for a
# bf16 gather) and, at 64 heads, 67 MB of scores per group; bs 64 at 8k context is two groups.
DEFAULT_MAX_PADDED_ROWS = 1 << 18


def decode_chunks(lengths: Sequence[int], max_rows: int) -> list[list[int]]:
    """Indices into ``lengths`` in groups with ``len(group) * max(length) <= max_rows`` (one
    request over ``max_rows`` is a group by itself), shortest first so padding stays small."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    groups: list[list[int]] = []
    group: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        # sorted ascending: lengths[i] is the longest of group + [i]
        if group and (len(group) + 1) * lengths[i] > max_rows:
            groups.append(group)
            group = []
        group.append(i)
    if group:
        groups.append(group)
    return groups


@dataclass(frozen=True)
class PagedLatents:
    """Requests' latent rows in one block store: row ``j`` of request ``b`` is
    ``store[table[b, j // R], j % R]``, the first ``lengths[b]`` live; ``table`` covers the
    longest request's blocks (``longest`` rows, known on the host)."""

    store: Tensor  # [num_blocks + 1, R, L + rope], or FP8 rows [num_blocks + 1, R, row_bytes]
    table: Tensor  # [B, ceil(longest / R)] int64
    lengths: Tensor  # [B] int64
    longest: int
    encoding: RowCodec | None = None  # None: the latents in the store's dtype

    @property
    def fp8(self) -> Fp8RowFormat | None:
        return fp8_format(self.encoding)


def paged_latents(caches: Sequence[MLALatentCache]) -> PagedLatents | None:
    """The caches' rows as one :class:`PagedLatents` when they are pages of one store, else None.
    Every request needs >= 1 row."""
    if not caches:
        raise ValueError("paged_latents needs at least one cache")
    lens = [len(c) for c in caches]
    if min(lens) < 1:
        raise ValueError(f"every request needs >= 1 latent row to attend over, got {lens}")
    first = caches[0].rows
    paged = [c.rows for c in caches if isinstance(c.rows, PagedRows)]
    if len(paged) != len(caches) or any(r.buf is not first.buf for r in paged):
        return None
    nb = -(-max(lens) // first.buf.shape[1])
    table = torch.stack([r.table_row[:nb] for r in paged])  # [B, nb]
    lengths = torch.tensor(lens, dtype=torch.long, device=first.buf.device)
    return PagedLatents(first.buf, table, lengths, max(lens), caches[0].encoding)


def decode_kernel_unavailable(caches: Sequence[MLALatentCache], rope_dim: int) -> str | None:
    """Why :func:`absorbed_decode_paged` cannot take these caches' latents (None: it can)."""
    first = caches[0].rows if caches else None
    if first is None or not all(
        isinstance(c.rows, PagedRows) and c.rows.buf is first.buf for c in caches
    ):
        return "the latents are not pages of one block store"
    if not triton_can_run(first.buf):
        return "Triton cannot run on the latents' device"
    fp8 = fp8_format(caches[0].encoding)
    width = first.buf.shape[-1] if fp8 is None else fp8.dim
    return absorbed_decode_unfit_reason(
        width - rope_dim, rope_dim, first.buf.dtype, limits_for(first.buf), fp8
    )


def gather_latents(caches: Sequence[MLALatentCache]) -> tuple[Tensor, Tensor]:
    """``(kv [B, S, D] fp32, lengths [B] int64)`` of the caches' rows; rows past a request's
    length are zero (a paged gather reads its last block's unused rows and the null block, which
    may hold a former owner's rows: zeroed so a non-finite one cannot reach ``0 * x``)."""
    paged = paged_latents(caches)
    if paged is not None:
        kv = gather_paged(paged.store, paged.table, paged.lengths, paged.longest, paged.encoding)
        return kv, paged.lengths
    lens = [len(c) for c in caches]
    lengths = torch.tensor(lens, dtype=torch.long, device=caches[0].rows.buf.device)
    rows = [c.values(torch.float32) for c in caches]  # zero-padded past each length
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), lengths


def gather_paged(
    store: Tensor, table: Tensor, lengths: Tensor, s: int, encoding: RowCodec | None = None
) -> Tensor:
    """``[B, s, D]`` fp32: rows ``0 .. s - 1`` of each request through its block-table row
    ``table [B, >= ceil(s / rows_per_block)]`` into ``store [blocks + 1, rows_per_block, width]``
    (decoded by ``encoding``: FP8 rows), zero past ``lengths [B]``. One gather, no host sync
    (``s`` is the host's longest length)."""
    per_block = store.shape[1]
    nb = -(-s // per_block)
    kv = store[table[:, :nb]].reshape(table.shape[0], nb * per_block, store.shape[-1])
    kv = kv[:, :s]
    kv = kv.float() if encoding is None else encoding.decode(kv, torch.float32)
    valid = torch.arange(s, device=store.device) < lengths[:, None]
    return kv.masked_fill_(~valid[..., None], 0.0)


def absorbed_decode(
    q: Tensor,
    kv: Tensor,
    lengths: Tensor,
    w_kc: Tensor,
    w_vc: Tensor,
    *,
    rope_dim: int,
    scale: float,
) -> Tensor:
    """``q [B, h, nope + rope]`` over ``kv [B, S, L + rope]`` (fp32, the first ``lengths[b]``
    rows of request ``b`` valid) with fp32 ``w_kc [h, nope, L]``, ``w_vc [h, v, L]`` ->
    ``[B, h, v]`` fp32."""
    b, qk = q.shape[0], q.shape[-1]
    latent = w_kc.shape[-1]
    if kv.shape[0] != b or kv.shape[-1] != latent + rope_dim or qk != w_kc.shape[1] + rope_dim:
        raise ValueError(
            f"absorbed decode shapes disagree: q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
            f"w_kc {tuple(w_kc.shape)}, rope {rope_dim}"
        )
    q_nope, q_pe = q.float().split([qk - rope_dim, rope_dim], dim=-1)
    ckv, k_pe = kv.split([latent, rope_dim], dim=-1)
    q_lat = torch.einsum("bhn,hnl->bhl", q_nope, w_kc)
    scores = (q_lat @ ckv.transpose(1, 2) + q_pe @ k_pe.transpose(1, 2)) * scale  # [B, h, S]
    valid = torch.arange(kv.shape[1], device=kv.device) < lengths[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    o_lat = torch.softmax(scores, dim=-1) @ ckv  # [B, h, L]
    return torch.einsum("bhl,hvl->bhv", o_lat, w_vc)


def absorbed_decode_paged(
    q: Tensor,
    latents: PagedLatents,
    w_kc: Tensor,
    w_vc: Tensor,
    *,
    rope_dim: int,
    scale: float,
) -> Tensor:
    """:func:`absorbed_decode` over ``latents`` read in place by the flash-decoding kernel
    (:func:`decode_kernel_unavailable` must be None): ``q [B, h, nope + rope]`` -> ``[B, h, v]``
    fp32. The fp32 ``q_lat`` and probabilities enter the kernel's bf16 products as exact parts,
    so this equals the torch pass up to summation order."""
    qk = q.shape[-1]
    if q.shape[0] != latents.table.shape[0] or qk != w_kc.shape[1] + rope_dim:
        raise ValueError(
            f"absorbed decode shapes disagree: q {tuple(q.shape)}, "
            f"{latents.table.shape[0]} requests, w_kc {tuple(w_kc.shape)}, rope {rope_dim}"
        )
    q_nope, q_pe = q.split([qk - rope_dim, rope_dim], dim=-1)
    q_lat = torch.einsum("bhn,hnl->bhl", q_nope.float(), w_kc)
    # q_pe stays in the model dtype: one part when that is the store's (bf16 values are exact)
    o_lat = absorbed_mla_decode(
        q_lat, q_pe, latents.store, latents.table, latents.lengths, scale, fp8=latents.fp8
    )
    return torch.einsum("bhl,hvl->bhv", o_lat, w_vc)
