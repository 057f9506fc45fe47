"""What turns a DeepSeek V4 compressor's pooled block into its entry, shared by the decode and
prefill kernels: the parameters (``EntryMaths``), the RMSNorm + RoPE (``norm_rope_entry``) and
the checks on the inputs both kernels read the same way (``entry_input_reason``)."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason

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
    kv: torch.Tensor, score: torch.Tensor, dim: int, rope_half: int, entry_dtype: torch.dtype
) -> str | None:
    """Why a compressor kernel cannot take these projections / this entry layout (None: it can)."""
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


def compressor_unfit_reason() -> str | None:
    """The compressor kernels hold one entry row a program (at most a few KiB of shared memory
    at every width the entry check admits: 2 KiB at 512 on sm_90), so only the family switch
    can refuse them."""
    return unfit_reason("compressor")


def entry_warps(dim: int) -> int:
    return 4 if dim <= 128 else 8


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
