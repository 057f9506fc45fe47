"""DeepSeek V4 KV compressor: pools every block of ``ratio`` tokens into one compressed entry.

Per token, ``kv = x @ wkv^T`` and ``score = x @ wgate^T`` (fp32), each ``coff * D`` wide
(``coff = 2`` with overlapping windows, ratio 4; else 1). Entry ``n`` pools block ``n`` (tokens
``n*ratio .. n*ratio+ratio-1``) with a per-channel softmax over its candidates of
``score + ape[slot]``, weighting ``kv``:
- no overlap: the ``ratio`` tokens of the block;
- overlap: the previous block's tokens through their *first* D channels (``ape[:, :D]``) and the
  block's own tokens through their *second* D channels (``ape[:, D:]``) -- ``2 * ratio``
  candidates; block 0 has no previous block (those candidates get weight 0).
Then RMSNorm (fp32 weight) and RoPE on the last rope dims at position ``n * ratio`` (the block's
first token). An entry exists once its block is complete.

The same module serves the attention (D = head_dim) and the ratio-4 indexer (D = index_head_dim).
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.kernels.ops.attention.compressor_entry import EntryMaths
from sglang.kernels.ops.attention.compressor_prefill import (
    compress_prefill,
    compress_prefill_reason,
)
from sglang.kernels.ops.triton_dispatch import triton_can_run
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.kv_cache_rows import fp8_format
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear, fp32_param
from sglang.srt.layers.rotary_embedding import InterleavedRotaryEmbedding, apply_interleaved_rope
from sglang.srt.mem_cache.compressor_state import CompressorState
from sglang.srt.utils.log import get_logger, log_path_once

logger = get_logger(__name__)


class KVCompressor(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        dim: int,
        ratio: int,
        spec: LayerBuildSpec,
        *,
        overlap: bool,
        rms_eps: float,
    ) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = (2 if overlap else 1) * dim
        self.wkv = ReplicatedLinear(hidden_size, width, spec)
        self.wgate = ReplicatedLinear(hidden_size, width, spec)
        # Both weights live in one [2 * width, H] buffer (wkv's rows, then wgate's), so
        # :meth:`project` can run them as one GEMM; the parameters, their names and their loaders
        # stay as they are (loading copies into them in place).
        both = torch.empty(2 * width, hidden_size, dtype=spec.dtype, device=spec.device)
        self.wkv.weight.data = both[:width]
        self.wgate.weight.data = both[width:]
        self.ape = fp32_param(ratio, width, device=spec.device)
        self.norm = RMSNorm(dim, rms_eps, device=spec.device)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> fp32 ``(kv, score)``, each ``[T, coff*D]`` (fp32 accumulation and output:
        the pooling softmax is sensitive to rounded scores). On CUDA with half-precision
        operands, one GEMM over both weights (one launch instead of two; each output is the
        same fp32-accumulated dot product): the results are column halves of one tensor."""
        both = self._both_weights() if _one_gemm(x, self.wkv.weight) else None
        if both is None:
            return _fp32_matmul(x, self.wkv.weight), _fp32_matmul(x, self.wgate.weight)
        out = _fp32_matmul(x, both)
        width = self.wkv.weight.shape[0]
        return out[..., :width], out[..., width:]

    def _both_weights(self) -> torch.Tensor | None:
        """``[wkv; wgate]`` as one view, while they still share the buffer ``__init__`` gave them
        (something that replaced a weight's storage since, such as ``Module.to``, ends it)."""
        a, b = self.wkv.weight, self.wgate.weight
        if a.dtype != b.dtype or a.device != b.device or a.shape[1:] != b.shape[1:]:
            return None
        if not (a.is_contiguous() and b.is_contiguous()):
            return None
        if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
            return None
        if b.storage_offset() != a.storage_offset() + a.numel():
            return None
        return a.detach().as_strided((a.shape[0] + b.shape[0], a.shape[1]), (a.shape[1], 1))

    def append(
        self,
        state: CompressorState,
        kv: torch.Tensor,
        score: torch.Tensor,
        rotary: InterleavedRotaryEmbedding,
    ) -> torch.Tensor:
        """Feed one request's next tokens' projections; emit (into ``state.entries``) and return the
        entries of every block they complete, ``[nb, width]`` as the state stores them (the model
        dtype, or FP8 rows: ``state.encoding``). Where Triton runs and the block fits one tile
        (ratio 4) one kernel pools every block and writes them in the stored form
        (``compress_prefill``; the torch chain below is its reference and the CPU path)."""
        enc = state.encoding
        if self._use_prefill_kernel(state, kv, score, rotary):
            pending_kv, pending_score = state.pending_buffers
            entries = compress_prefill(
                kv,
                score,
                pending_kv=pending_kv,
                pending_score=pending_score,
                num_pending=state.num_pending,
                prev_kv=state.prev_kv,
                prev_score=state.prev_score,
                first_block=state.num_entries,
                maths=self.entry_maths(rotary),
                entry_dtype=enc.dtype,
                fp8=fp8_format(enc),
            )
            state.finish_blocks(kv, score, entries.shape[0], self.ape)
            state.entries.append(entries)
            return entries
        blocks_kv, blocks_score, first = state.take_complete_blocks(kv, score)
        nb = blocks_kv.shape[0]
        if nb == 0:
            return state.entries.rows()[:0]
        blocks_score = blocks_score + self.ape.float()
        if self.overlap:
            d = self.dim
            assert state.prev_kv is not None and state.prev_score is not None
            # The first block's previous block is the kept one (or the "none" rows: 0, -inf).
            prev_kv = torch.cat([state.prev_kv[None], blocks_kv[:-1, :, :d]])
            prev_score = torch.cat([state.prev_score[None], blocks_score[:-1, :, :d]])
            state.set_previous(blocks_kv[-1, :, :d], blocks_score[-1, :, :d])
            cand_kv = torch.cat([prev_kv, blocks_kv[:, :, d:]], dim=1)
            cand_score = torch.cat([prev_score, blocks_score[:, :, d:]], dim=1)
        else:
            cand_kv, cand_score = blocks_kv, blocks_score
        blocks = first + torch.arange(nb, device=cand_kv.device)
        entries = enc.encode(self.emit(cand_kv, cand_score, blocks, rotary))
        state.entries.append(entries)
        return entries

    def entry_maths(self, rotary: InterleavedRotaryEmbedding) -> EntryMaths:
        """The parameters the compressor kernels make entries with (the torch chain's ``emit``)."""
        return EntryMaths(
            ape=self.ape,
            norm_weight=self.norm.weight,
            eps=self.norm.eps,
            inv_freq=rotary.inv_freq,
            rope_factor=rotary.spec.attention_factor,
        )

    def _use_prefill_kernel(
        self,
        state: CompressorState,
        kv: torch.Tensor,
        score: torch.Tensor,
        rotary: InterleavedRotaryEmbedding,
    ) -> bool:
        why = (
            compress_prefill_reason(
                kv,
                score,
                self.ratio,
                self.dim,
                self.overlap,
                rotary.inv_freq.shape[0],
                state.encoding.dtype,
                (*state.pending_buffers, state.prev_kv, state.prev_score),
                fp8=fp8_format(state.encoding),
            )
            if triton_can_run(kv)
            else "Triton cannot run on these tensors"
        )
        log_path_once(logger, f"DeepSeek V4 compressor prefill (ratio {self.ratio})", why)
        return why is None

    def emit(
        self,
        cand_kv: torch.Tensor,
        cand_score: torch.Tensor,
        blocks: torch.Tensor,
        rotary: InterleavedRotaryEmbedding,
    ) -> torch.Tensor:
        """The entries of blocks ``blocks [nb]`` from their candidates ``cand_kv`` /
        ``cand_score [nb, candidates, D]`` (fp32, ``ape`` already added to the scores):
        softmax-pool, RMSNorm, RoPE at the block's first position, in fp32 (the caller encodes
        them as its cache stores them: a cast to the model dtype, or FP8 rows).

        Shared by :meth:`append` and the static decode step so both emit with the same ops in
        the same order (the static path's only difference from the reference is summation order
        elsewhere)."""
        pooled = (torch.softmax(cand_score, dim=1) * cand_kv).sum(dim=1)
        normed = self.norm(pooled)
        cos, sin = rotary.cos_sin(blocks * self.ratio)
        return apply_interleaved_rope(normed, cos, sin)


def _one_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where :func:`_fp32_matmul` is one half-precision GEMM with fp32 output (elsewhere both
    weights are upcast per call anyway, and the CPU results stay those of two products)."""
    return x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)


def _fp32_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` with fp32 output. On CUDA, half-precision operands go to one GEMM with
    fp32 accumulation and output (the products are exact in fp32, as in the upcast product)
    instead of upcasting the whole weight every call (a 2x-sized copy read and written per
    decode step). Elsewhere the operands are upcast."""
    if _one_gemm(x, weight):
        return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(
            *x.shape[:-1], weight.shape[0]
        )
    return x.float() @ weight.float().t()
