"""What turns a DeepSeek V4 compressor's block into its entry, shared by the decode and prefill
kernels: where a block's pooling candidates lie and their load (``candidate_rows``,
``load_candidates``), the pooling softmax of one tile (``softmax_pool``), the parameters
(``EntryMaths``), the RMSNorm + RoPE (``norm_rope_entry``), the
entry's store in the cache's form (``store_entry``: a cast, or an FP8 row quantised in place),
the checks on the inputs both kernels read the same way (``entry_input_reason``,
``pooling_width_factor``) and their compile options (``entry_launch_options``)."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.ops.quant.fp8_rows import (
    Fp8RowFormat,
    group_exponent,
    group_exponents,
    store_row,
    store_scales,
)
from sglang.kernels.ops.triton_dispatch import interpreter_enabled

TILE_ELEMS = 4096  # candidates x D/2 in one register tile
ENTRY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class EntryMaths:
    """A compressor's per-entry parameters: ``ape [ratio, coff*D]`` added to the scores before
    the pooling softmax, the RMSNorm ``norm_weight [D]`` and ``eps``, the rotary ``inv_freq
    [half]`` (the last ``2 * half`` channels rotate) and its attention factor."""

    ape: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    inv_freq: torch.Tensor
    rope_factor: float

    @property
    def dim(self) -> int:
        return self.norm_weight.shape[0]

    @property
    def rope_half(self) -> int:
        return self.inv_freq.shape[0]

    def fp32_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ape, norm_weight, inv_freq)`` as the kernels read them: contiguous fp32."""
        return (
            self.ape.float().contiguous(),
            self.norm_weight.float().contiguous(),
            self.inv_freq.float().contiguous(),
        )


def entry_input_reason(
    kv: torch.Tensor,
    score: torch.Tensor,
    dim: int,
    rope_half: int,
    entry_dtype: torch.dtype,
    fp8: Fp8RowFormat | None = None,
) -> str | None:
    """Why a compressor kernel cannot take these projections / this entry layout (None: it can);
    ``fp8``: the entries are FP8 rows of that format (else ``entry_dtype`` values)."""
    if fp8 is not None and fp8.dim != dim:
        return f"FP8 rows of {fp8.dim} values for entries of {dim}"
    if dim < 2 or dim & (dim - 1):
        return f"the kernel needs a power-of-two entry width, got {dim}"
    if not 0 < 2 * rope_half <= dim:
        return f"rope dims {2 * rope_half} do not fit the entry width {dim}"
    if entry_dtype not in ENTRY_DTYPES:
        return f"the kernel writes fp32/bf16/fp16 entries, not {entry_dtype}"
    if kv.dtype != torch.float32 or score.dtype != torch.float32:
        return "the kernel takes fp32 projections"
    if kv.dim() != 2 or kv.stride(-1) != 1 or score.dim() != 2 or score.stride(-1) != 1:
        return "the kernel takes 2-D projections with unit channel stride"
    return compressor_unfit_reason()


def pooling_width_factor(
    kv: torch.Tensor,
    score: torch.Tensor,
    pending_kv: torch.Tensor,
    prev_kv: torch.Tensor | None,
    prev_score: torch.Tensor | None,
    dim: int,
) -> int:
    """``coff``, the projections' width over the entry width ``dim``: 2 with overlap (``prev_kv``
    and ``prev_score`` given), else 1; a ``ValueError`` when the previous block comes half given
    or ``kv`` / ``score`` and the pending rows are not all ``coff * dim`` wide."""
    if (prev_score is None) != (prev_kv is None):
        raise ValueError("prev_kv and prev_score come together (overlap) or not at all")
    coff = 2 if prev_kv is not None else 1
    width = kv.shape[-1]
    if kv.shape != score.shape or pending_kv.shape[-1] != width or width != coff * dim:
        raise ValueError(
            f"kv/score {tuple(kv.shape)}/{tuple(score.shape)} and pending rows "
            f"{tuple(pending_kv.shape)} do not match {coff} x entry width {dim}"
        )
    return coff


def entry_launch_options() -> dict[str, bool]:
    """The compile options of the compressor kernels: fp-contraction off on the GPU, since the
    torch path rounds every product (a fused ``e*c - o*s`` would not); none in the
    interpreter."""
    return {} if interpreter_enabled() else {"enable_fp_fusion": False}


def compressor_unfit_reason() -> str | None:
    """The compressor kernels hold one entry row a program (at most a few KiB of shared memory
    at every width the entry check admits: 2 KiB at 512 on sm_90), so only the family switch
    can refuse them."""
    return unfit_reason("compressor")


def entry_warps(dim: int) -> int:
    return 4 if dim <= 128 else 8


@triton.jit
def candidate_rows(
    cand, ch, NC: tl.constexpr, RATIO: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
    OVERLAP: tl.constexpr,
):  # fmt: skip
    """Where the pooling candidates ``cand`` of a block lie -> ``(valid, own, j, col)``:
    ``valid`` below ``NC``; with ``OVERLAP`` the first ``RATIO`` are the previous block's rows
    read through channels ``[:D]``, the rest (``own``) this block's rows through ``[D:]``; ``j``
    the row in its block, ``col`` the columns ``[CHUNK, len(ch)]`` of channels ``ch``."""
    valid = cand < NC
    if OVERLAP:
        own = valid & (cand >= RATIO)
        j = tl.where(own, cand - RATIO, cand)
        col = tl.where(own, D, 0)[:, None] + ch[None, :]
    else:
        own = valid
        j = cand
        col = tl.zeros([CHUNK], tl.int64)[:, None] + ch[None, :]
    return valid, own, j, col


@triton.jit
def load_candidates(
    kv_p, sc_p, ape_ptr, j, col, valid, ch, with_ape, D: tl.constexpr, W: tl.constexpr
):
    """The pooling candidates at ``kv_p`` / ``sc_p`` (``[CHUNK, len(ch)]`` pointers; candidate
    ``c`` is row ``j[c]`` of the block, columns ``col[c]``) -> ``(kv, score + ape)``; rows not
    ``valid`` (and channels past ``D``): kv 0, score -inf (softmax weight 0). ``ape`` is added
    only where ``with_ape``: rows of a kept previous block already carry theirs (added when they
    were a block's own)."""
    m = valid[:, None] & (ch[None, :] < D)
    kv = tl.load(kv_p, mask=m, other=0.0)
    sc = tl.load(sc_p, mask=m, other=float("-inf"))
    ape = tl.load(ape_ptr + j[:, None] * W + col, mask=m & with_ape[:, None], other=0.0)
    return kv, sc + ape


@triton.jit
def softmax_pool(kv, sc):
    """``sum_c softmax_c(sc)[c] * kv[c]`` over the candidates (axis 0) of one tile, fp32."""
    e = tl.exp(sc - tl.max(sc, axis=0)[None, :])
    prob = e / tl.sum(e, axis=0)[None, :]
    return tl.sum(prob * kv, axis=0)


@triton.jit
def norm_rope_entry(
    even, odd, i, block, norm_w_ptr, inv_freq_ptr, eps, rope_factor,
    RATIO: tl.constexpr, D: tl.constexpr, ROPE_HALF: tl.constexpr,
):  # fmt: skip
    """RMSNorm and RoPE of block ``block``'s pooled row (``even`` / ``odd`` channels ``2i`` /
    ``2i + 1``, fp32) -> the entry's channels, fp32: ``KVCompressor.emit``'s maths after the
    pooling."""
    # RMSNorm: x * rsqrt(mean(x^2) + eps) * weight
    rs = tl.rsqrt((tl.sum(even * even, axis=0) + tl.sum(odd * odd, axis=0)) / D + eps)
    even = even * rs * tl.load(norm_w_ptr + 2 * i)
    odd = odd * rs * tl.load(norm_w_ptr + 2 * i + 1)
    # RoPE on the last ROPE_HALF pairs at the block's first position
    k = i - (D // 2 - ROPE_HALF)
    rot = k >= 0
    inv = tl.load(inv_freq_ptr + k, mask=rot, other=0.0)
    freq = (block * RATIO).to(tl.float32) * inv
    c = tl.cos(freq) * rope_factor
    s = tl.sin(freq) * rope_factor
    out_even = tl.where(rot, even * c - odd * s, even)
    out_odd = tl.where(rot, odd * c + even * s, odd)
    return out_even, out_odd


@triton.jit
def store_entry(
    dst, even, odd, i,
    FP8: tl.constexpr, FP8_F: tl.constexpr, FP8_ROPE: tl.constexpr, FP8_ROPE_OFF: tl.constexpr,
    FP8_SCALE_OFF: tl.constexpr, FP8_G: tl.constexpr, FP8_NG: tl.constexpr,
    FP8_SCALES: tl.constexpr,
):  # fmt: skip
    """An entry's channels ``2i`` / ``2i + 1`` (``even`` / ``odd``, fp32) into its row at ``dst``:
    cast to the entries' dtype, or (``FP8``) quantised as one FP8 row: the group maxima over both
    halves, then the e4m3 codes, the bf16 tail and the scales (``fp8_rows.py``)."""
    if FP8:
        ce = 2 * i
        co = 2 * i + 1
        amax = tl.maximum(
            group_exponents(even, ce, FP8_F, FP8_G, FP8_NG),
            group_exponents(odd, co, FP8_F, FP8_G, FP8_NG),
        )
        k = group_exponent(amax)
        store_row(dst, even, ce, k, FP8_F, FP8_ROPE, FP8_ROPE_OFF, FP8_G, FP8_NG)
        store_row(dst, odd, co, k, FP8_F, FP8_ROPE, FP8_ROPE_OFF, FP8_G, FP8_NG)
        store_scales(dst, k, FP8_SCALE_OFF, FP8_NG, FP8_SCALES)
    else:
        ty = dst.dtype.element_ty
        tl.store(dst + 2 * i, even.to(ty))
        tl.store(dst + 2 * i + 1, odd.to(ty))
