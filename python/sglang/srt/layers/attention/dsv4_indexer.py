"""DeepSeek V4's lightning indexer (ratio-4 layers): picks which compressed entries a query attends.

Query side: ``q = wq_b(q_lora)`` viewed ``[T, index_n_heads, index_head_dim]`` with RoPE on the
last rope dims (the layer's compressed-rope), and per-head weights
``w = weights_proj(x) * index_n_heads^-0.5``. Key side: a ratio-4 overlapping compressor of width
``index_head_dim`` (its own entries, aligned with the attention compressor's).
Score of entry ``s`` for a query: ``sum_h w_h * relu(q_h . k_s) * index_head_dim^-0.5``; the query
keeps the ``index_topk`` best of its *visible* entries (``s < (p+1) // ratio``), all of them when
fewer are visible; ties go to the earlier entry. Exact for any context length: no cap, scores are
computed in query chunks. The prefill kernel path (:meth:`LightningIndexer.pick`) scores on CUDA
with the Triton ``indexer_scores`` (half-precision products are exact; the sums' order differs
from the fp32 torch scoring, so a near-tie at the k-th place may pick differently).

(SGLang additionally applies a Hadamard rotation to q and k before an FP8 cast; the rotation is
orthogonal, so without the FP8 cast it leaves every score unchanged and is omitted here. With
``--kv-cache-dtype fp8_e4m3`` the keys are FP8 rows, still unrotated: e4m3 is a floating format
whose relative error per value does not depend on the other values of its group, so spreading
outliers buys nothing the per-64 scales do not (docs/kv_cache.md).)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from sglang.kernels.fit.decide import limits_for
from sglang.kernels.ops.attention.indexer_scores import indexer_scores, indexer_unfit_reason
from sglang.kernels.ops.attention.sparse_decode_attention import kernel_head_dim_ok
from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat
from sglang.srt.layers.attention.dsv4_compressor import KVCompressor
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.linear import LinearInput, ReplicatedLinear
from sglang.srt.layers.norm_rope import norm_rope
from sglang.srt.layers.quantization.dense_quant import DenseQuant

# Queries scored at once; bounds the [chunk, heads, entries] temporary.
_QUERY_CHUNK = 256
# Queries the Triton scores take at once; bounds the [chunk, entries] fp32 scores.
_KERNEL_CHUNK = 4096


def scores_kernel_reason(
    q: torch.Tensor, keys: torch.Tensor, key_fp8: Fp8RowFormat | None = None
) -> str | None:
    """None when :func:`indexer_scores` scores ``q`` against ``keys`` (FP8 rows of ``key_fp8``,
    or values), else why the torch scoring runs. CUDA only (the eager prefill; the interpreter
    runs the kernel in its own tests)."""
    if not q.is_cuda:
        return "the indexer scores kernel runs on CUDA only"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q is {q.dtype}: the kernel takes half-precision queries"
    if key_fp8 is None and q.dtype != keys.dtype:
        return f"q {q.dtype} and keys {keys.dtype}: the kernel takes one dtype"
    if key_fp8 is not None and q.dtype != torch.bfloat16:
        return f"FP8 keys dequantise into bf16, q is {q.dtype}"
    if not kernel_head_dim_ok(q.shape[-1]) or keys.stride(-1) != 1:
        return f"indexer head dim {q.shape[-1]} is not a power of two >= 16, or rows not contiguous"
    return indexer_unfit_reason(q.shape[-2], q.shape[-1], limits_for(q))


class LightningIndexer(nn.Module):
    def __init__(
        self,
        spec: LayerBuildSpec,
        *,
        hidden_size: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        ratio: int,
        topk: int,
        rms_eps: float,
        dense_quant: DenseQuant | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.ratio, self.topk = n_heads, head_dim, ratio, topk
        # wq_b ships as the attention projections do (FP8 in the release); the rest is float.
        self.wq_b = ReplicatedLinear(
            q_lora_rank, n_heads * head_dim, spec.with_dense_quant(dense_quant)
        )
        self.weights_proj = ReplicatedLinear(hidden_size, n_heads, spec)
        self.compressor = KVCompressor(
            hidden_size, head_dim, ratio, spec, overlap=True, rms_eps=rms_eps
        )

    def queries(
        self, q_lora: LinearInput, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q ``[T, heads, head_dim]`` rope'd, fp32 head weights ``[T, heads]``). ``q_lora``
        may come quantised for an FP8 ``wq_b``."""
        q = self.wq_b(q_lora).unflatten(-1, (self.n_heads, self.head_dim))
        q = norm_rope(q, cos, sin, reuse_input=True)  # one fused kernel on the GPU
        w = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, w

    def select(
        self,
        q: torch.Tensor,
        w: torch.Tensor,
        keys: torch.Tensor,
        positions: torch.Tensor,
        key_fp8: Fp8RowFormat | None = None,
    ) -> torch.Tensor:
        """Boolean ``[n, N]``: which of the ``N`` entries ``keys [N, head_dim]`` (or FP8 rows of
        ``key_fp8``) each query at ``positions [n]`` attends."""
        if key_fp8 is not None:
            keys = key_fp8.dequantize(keys)
        n, num = q.shape[0], keys.shape[0]
        chosen = torch.zeros(n, num, dtype=torch.bool, device=q.device)
        for a, b, top, ok in self._chunk_tops(q, w, keys, positions):
            picked = torch.zeros(b - a, num, dtype=torch.bool, device=q.device)
            picked.scatter_(1, top, True)
            # A query with fewer than k visible entries also "picked" invisible ones; drop them.
            chosen[a:b] = picked & ok
        return chosen

    def pick(
        self,
        q: torch.Tensor,
        w: torch.Tensor,
        keys: torch.Tensor,
        positions: torch.Tensor,
        key_fp8: Fp8RowFormat | None = None,
    ) -> torch.Tensor:
        """The entries :meth:`select` marks, as ids: ``[n, k]`` best first, ``k = min(topk, N)``.
        A query at ``p`` attends its first ``min(k, (p + 1) // ratio)`` picks (the stable sort
        puts every visible entry before the invisible ones); the rest are arbitrary. ``keys``:
        values, or FP8 rows of ``key_fp8`` (the kernel reads them as they are)."""
        n, num = q.shape[0], keys.shape[0]
        k = min(self.topk, num)
        picks = torch.empty(n, k, dtype=torch.int64, device=q.device)
        if scores_kernel_reason(q, keys, key_fp8) is None and n > 0 and num > 0:
            # The Triton scores: only the visible keys of each query, bf16 products (exact) with
            # fp32 sums, -inf past the visible ones; then the same stable sort as top_entries.
            visible = (positions + 1) // self.ratio
            slot = torch.zeros(min(n, _KERNEL_CHUNK), dtype=torch.int64, device=q.device)
            for a in range(0, n, _KERNEL_CHUNK):
                b = min(a + _KERNEL_CHUNK, n)
                scores = indexer_scores(
                    q[a:b],
                    w[a:b],
                    keys[None],
                    slot[: b - a],
                    visible[a:b],
                    self.head_dim**-0.5,
                    key_fp8=key_fp8,
                )
                picks[a:b] = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
            return picks
        if key_fp8 is not None:
            keys = key_fp8.dequantize(keys)
        for a, b, top, _ok in self._chunk_tops(q, w, keys, positions):
            picks[a:b] = top
        return picks

    def _chunk_tops(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(a, b, :meth:`top_entries` of queries ``a .. b-1``) per chunk of queries."""
        n, num = q.shape[0], keys.shape[0]
        if num == 0 or n == 0:
            return
        visible = (positions + 1) // self.ratio  # entries 0 .. visible-1
        # Cast once for all chunks (top_entries' own .float() is then a no-op).
        kf = keys.float()
        for a in range(0, n, _QUERY_CHUNK):
            b = min(a + _QUERY_CHUNK, n)
            yield a, b, *self.top_entries(q[a:b], w[a:b], kf, visible[a:b])

    def top_entries(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The scoring both the eager :meth:`select` and the static decode use:
        ``q [n, heads, d]``, ``w [n, heads]``, ``keys`` ``[N, d]`` (shared by every query) or
        ``[n, N, d]`` (per query), ``visible [n]`` (entries ``0 .. visible-1`` exist) ->
        (entry indices ``[n, k]`` best first, which entries are visible ``[n, N]``),
        ``k = min(topk, N)``. Past the visible ones the picks are arbitrary; callers mask them."""
        num = keys.shape[-2]
        spec = "qhd,nd->qhn" if keys.dim() == 2 else "qhd,qnd->qhn"
        dots = torch.einsum(spec, q.float(), keys.float()).relu() * self.head_dim**-0.5
        scores = (dots * w.unsqueeze(-1)).sum(dim=1)
        entry = torch.arange(num, device=keys.device)
        ok = entry[None, :] < visible[:, None]
        scores = scores.masked_fill(~ok, float("-inf"))
        # Stable sort: equal scores (common: an entry whose every head is ReLU'd to 0 scores
        # exactly 0) go to the earlier entry, whatever the number of entries or queries in
        # the call, so chunked prefill and decode pick what a full forward picks.
        k = min(self.topk, num)
        top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        return top, ok
