"""MXFP4 -> FP8 e4m3 with one power-of-two scale per 128x128 block, lossless where a block allows.

Hopper has no FP4 matrix instructions, so DeepGEMM's grouped GEMMs and its ``fp8_mega_moe`` take
FP8 128x128-block experts. MXFP4 experts are converted once at load, and the conversion is exact
for every block whose values fit one e4m3 range, which is almost all of them.

Why it can be exact. An MXFP4 value is ``v = m * 2^e``: ``m`` an E2M1 magnitude
``{0.5, 1, 1.5, 2, 3, 4, 6}`` (at most two significant bits) with a sign, ``e = s - 127`` its
32-value group's UE8M0 exponent. The FP8 block stores ``q = v / 2^t`` for a block exponent ``t``.
e4m3 (bias 7, three mantissa bits) holds exactly:
- every value of at most four significant bits from its smallest normal ``2^-6`` up to its
  largest finite value ``448 = 1.75 * 2^8``;
- below ``2^-6``, the subnormals ``k * 2^-9`` for ``k = 1..7``.
Two significant bits always fit the mantissa, so ``q`` is exact iff it is at most 448 and a
multiple of ``2^-9``. Write ``top(v) = floor(log2 |v|)`` and ``low(v)`` for the exponent of the
lowest set bit of ``|v|`` (``0.5, 1, 1.5, 2, 3, 4, 6`` have ``top = -1, 0, 0, 1, 1, 2, 2`` and
``low = -1, 0, -1, 1, 0, 2, 1``). Since ``|v| <= 1.5 * 2^top(v)`` and ``1.5 * 2^8 <= 448 <
2^9``, the block's non-zero values are all exact iff

    hi - 8 <= t <= lo + 9,   hi = max top(v),  lo = min low(v)   over the block,

so a block converts exactly iff ``hi - lo <= 17``, and then ``t = hi - 8`` is exact (it puts
the block's largest value at 256 or 384). In scale terms: ``hi <= e_max + 2`` and
``lo >= e_min - 1`` over the block's 512 group exponents, so **every block whose 32-value scales
span ``e_max - e_min <= 14`` (a factor of ``2^14``) is exact whatever its codes**; a wider span is
exact only if its extreme codes do not meet. The check below is the value-level one, per block.

A block that is not exact (``hi - lo > 17``) takes ``t = hi - 8`` too: no value overflows, the
largest are exact, and the values below ``2^(t-9)`` round to the nearest e4m3 subnormal (round to
nearest even), an absolute error of at most ``2^(t-10) = 2^(hi-18)``, i.e. at most ``2^-18`` of
the block's largest magnitude. Any smaller ``t`` overflows the largest value, any larger one
doubles the rounding step, so this is the least maximum error. Such blocks are counted
(:class:`ConversionStats`).

Block scales are fp32 powers of two (``2^t``), which are also valid UE8M0 scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.layers.quantization.mxfp4 import (
    MXFP4_DTYPES,
    MXFP4_GROUP,
    UE8M0_BIAS,
    dequant_mxfp4,
)

FP8_BLOCK = 128
GROUPS_PER_BLOCK = FP8_BLOCK // MXFP4_GROUP
# e4m3: a block exponent puts the largest value at 2^8 (or 1.5 * 2^8 = 384 <= 448); subnormals
# reach 2^-9, 17 binades below.
TOP_EXPONENT = 8
EXACT_SPAN = 17
# The scale-only sufficient condition (hi <= e_max + 2, lo >= e_min - 1): 17 - 3.
EXACT_SCALE_SPAN = 14
# Values below 2^(t - 9) round to a subnormal step of 2^(t - 9): half a step at most.
MAX_ERROR_TO_AMAX = 2.0**-18

# E2M1 magnitude code (0..7) -> floor(log2 m) and the exponent of m's lowest set bit; code 0 (a
# zero) gets sentinels that lose every max / min.
_NO_TOP, _NO_LOW = -(1 << 14), 1 << 14
_TOP = (_NO_TOP, -1, 0, 0, 1, 1, 2, 2)
_LOW = (_NO_LOW, -1, 0, -1, 1, 0, 2, 1)


@dataclass(frozen=True)
class ConversionStats:
    """How a conversion went: FP8 blocks made, those not exact, the largest error of those
    relative to their block's largest magnitude, and the bytes before and after."""

    blocks: int = 0
    inexact_blocks: int = 0
    max_error_to_amax: float = 0.0
    mxfp4_bytes: int = 0
    fp8_bytes: int = 0

    def __add__(self, other: ConversionStats) -> ConversionStats:
        return ConversionStats(
            self.blocks + other.blocks,
            self.inexact_blocks + other.inexact_blocks,
            max(self.max_error_to_amax, other.max_error_to_amax),
            self.mxfp4_bytes + other.mxfp4_bytes,
            self.fp8_bytes + other.fp8_bytes,
        )


def _check(packed: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    if packed.dtype not in MXFP4_DTYPES or scales.dtype != torch.uint8:
        raise TypeError(
            f"MXFP4 -> FP8 takes packed uint8/int8 bytes and uint8 UE8M0 scales, got "
            f"{packed.dtype} and {scales.dtype}"
        )
    n, k = packed.shape[-2], packed.shape[-1] * 2
    if tuple(scales.shape) != (*packed.shape[:-1], k // MXFP4_GROUP):
        raise ValueError(
            f"MXFP4 scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)}"
        )
    if n % FP8_BLOCK or k % FP8_BLOCK:
        raise ValueError(
            f"MXFP4 -> FP8 {FP8_BLOCK}x{FP8_BLOCK} blocks needs rows ({n}) and values a row ({k}) "
            f"in multiples of {FP8_BLOCK}"
        )
    return n, k


def block_exponent_bounds(
    packed: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` per 128x128 block, int32 ``[..., N/128, K/128]``: the largest ``top(v)`` and
    the smallest ``low(v)`` of the block's non-zero values (sentinels far out of range for an
    all-zero block). Exact iff ``hi - lo <= 17`` (module docstring)."""
    n, k = _check(packed, scales)
    lead = packed.shape[:-2]
    raw = packed.view(torch.uint8)
    codes = torch.stack([raw & 0x07, (raw >> 4) & 0x07], dim=-1).flatten(-2).long()
    top_tab = torch.tensor(_TOP, dtype=torch.int32, device=packed.device)
    low_tab = torch.tensor(_LOW, dtype=torch.int32, device=packed.device)
    groups = (*lead, n, k // MXFP4_GROUP, MXFP4_GROUP)
    top = top_tab[codes].view(groups).amax(-1)
    low = low_tab[codes].view(groups).amin(-1)
    exp = scales.to(torch.int32) - UE8M0_BIAS
    # a group of zeros keeps its sentinel (the exponent would pull it into range)
    top = torch.where(top == _NO_TOP, top, top + exp)
    low = torch.where(low == _NO_LOW, low, low + exp)
    blocks = (*lead, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, GROUPS_PER_BLOCK)
    return top.view(blocks).amax(dim=(-3, -1)), low.view(blocks).amin(dim=(-3, -1))


def _convert_chunk(
    packed: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, ConversionStats]:
    hi, lo = block_exponent_bounds(packed, scales)
    nonzero = hi > _NO_TOP // 2
    exact = ~nonzero | (hi - lo <= EXACT_SPAN)
    t = torch.where(nonzero, hi - TOP_EXPONENT, torch.zeros_like(hi))
    scale = torch.exp2(t.float())
    full = scale.repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)
    values = dequant_mxfp4(packed, scales, torch.float32)
    q = (values / full).to(torch.float8_e4m3fn)
    inexact = int((~exact).sum())
    error = 0.0
    if inexact:
        # the worst error of the rounded blocks, relative to their largest magnitude
        diff = (q.float() * full - values).abs()
        shape = (*hi.shape[:-2], hi.shape[-2], FP8_BLOCK, hi.shape[-1], FP8_BLOCK)
        block_err = diff.view(shape).amax(dim=(-3, -1))
        block_amax = values.abs().view(shape).amax(dim=(-3, -1))
        rel = block_err[~exact] / block_amax[~exact]
        error = float(rel.max())
    stats = ConversionStats(
        blocks=hi.numel(),
        inexact_blocks=inexact,
        max_error_to_amax=error,
        mxfp4_bytes=packed.numel() * packed.element_size() + scales.numel(),
        fp8_bytes=q.numel() + scale.numel() * scale.element_size(),
    )
    return q, scale, stats


def mxfp4_to_fp8_blocks(
    packed: torch.Tensor, scales: torch.Tensor, *, experts_per_chunk: int = 4
) -> tuple[torch.Tensor, torch.Tensor, ConversionStats]:
    """Stacked MXFP4 ``[E, N, K/2]`` with UE8M0 ``[E, N, K/32]`` -> (e4m3 ``[E, N, K]``, fp32
    power-of-two block scales ``[E, N/128, K/128]``, stats). Exact wherever the block allows
    (module docstring); the work runs ``experts_per_chunk`` experts at a time on the tensors'
    device, so its fp32 temporaries stay a few experts wide."""
    n, k = _check(packed, scales)
    if packed.dim() != 3:
        raise ValueError(f"expected stacked experts [E, N, K/2], got {tuple(packed.shape)}")
    e = packed.shape[0]
    q = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device=packed.device)
    scale = torch.empty(
        (e, n // FP8_BLOCK, k // FP8_BLOCK), dtype=torch.float32, device=packed.device
    )
    stats = ConversionStats()
    for start in range(0, e, experts_per_chunk):
        stop = min(start + experts_per_chunk, e)
        q[start:stop], scale[start:stop], part = _convert_chunk(
            packed[start:stop], scales[start:stop]
        )
        stats = stats + part
    return q, scale, stats
