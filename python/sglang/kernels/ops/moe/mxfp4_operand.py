"""MXFP4 weight tiles dequantised in registers straight into the MMA's operand layout.

The W4A16 GEMMs (``fused_moe_mxfp4.py``) compute ``W @ X^T``: the weight tile is the MMA's left
operand ``[rows, BLOCK_K]`` (BLOCK_K = 128: one int32 word of four UE8M0 scales a row) and the
activations its right operand. A weight row's packed bytes are read as int32 words (eight E2M1
values each); each word becomes eight bf16 values in registers.

**Dot order.** The MMA's left-operand fragment gives a thread, per row and per 16-wide K step
``c``, the values ``k = 16c + 2q + t`` and ``16c + 8 + 2q + t`` (``q`` the lane within its quad,
``t`` in {0, 1}). The sum over K does not care which K is which as long as weights and activations
agree, so each tile's K is renumbered: logical ``kl = 16c + 8h + 2q + t`` holds the physical value

    p = q * BLOCK_K/4 + 8 * (c // 2) + 4t + 2 * (c % 2) + h.

Then a thread's values are the 32 contiguous physical values of its quad (16 bytes: one vector
load from shared memory, one scale group) and every bf16 pair the MMA wants
in one register is a pair the word trick below produces in one register: nothing is shuffled
between threads or through shared memory. The activations go through the same renumbering
(:func:`to_dot_order`, or once for the whole tensor ahead of the GEMM); GEMM 1 writes its output in
GEMM 2's dot order (:func:`dot_order_position`), so GEMM 2 reads it as it lies.

**Word trick** (the inline PTX, bf16 only): nibble ``a`` and ``a+4`` of a word sit 16 bits apart,
so one mask, one multiply (two shifts at once: the magnitude bits to bf16 bits 6-8, the sign to
bit 15) and one mask give both as bf16 bit patterns whose value is the E2M1 value times 2**-126
(exponent field = E2M1 exponent; the E2M1 subnormal 0.5 becomes the bf16 subnormal 2**-127, which
the bf16 multiply keeps). One ``mul.bf16x2`` by ``2**(s - 63)`` (an exact power of two, a normal
bf16 for any scale byte up to 190) then gives ``value * 2**(s-127) * 2**-62``: exact, and kept away
from bf16's subnormal range for scales down to ``2**-63``. The GEMMs multiply their fp32
accumulators by ``2**62`` (:data:`ASM_ACC_SCALE`). About two instructions per weight value.

The portable path (:func:`e2m1_tile`) computes the same values with plain Triton
arithmetic in fp32 (exact) and casts them to the operand dtype: fp16 activations and the
interpreter use it, and it shares everything else (loads, ordering, scales) with the fast path.
"""

from __future__ import annotations

import triton
import triton.language as tl

# (right shift of the word, mask of the two nibbles, multiplier placing magnitude and sign,
#  output of the low half, output of the high half): nibble i is element i of the word.
E2M1_WORD_PAIRS = (
    (0, 0x000F000F, (1 << 6) + (1 << 12), 0, 4),
    (0, 0x00F000F0, (1 << 2) + (1 << 8), 1, 5),
    (8, 0x000F000F, (1 << 6) + (1 << 12), 2, 6),
    (8, 0x00F000F0, (1 << 2) + (1 << 8), 3, 7),
)
BF16_E2M1_BITS = 0x81C081C0  # per half: sign (bit 15) and exponent/mantissa bits 6-8
# The bf16 multiplier 2**(s - 63) has exponent field s + 64 (s <= 190 keeps it finite).
ASM_SCALE_EXP_OFFSET = 64
ASM_SCALE_MAX_BYTE = 191  # larger scale bytes saturate to an infinite multiplier
ASM_ACC_EXP = 62
ASM_ACC_SCALE = float(2**ASM_ACC_EXP)
# The K extent of a weight tile: one scale word (four groups of 32) a row, 16 bytes a quad lane.
# (64 and 256 were tried: at 64 the compiler shuffles the dequantised tile between lanes, at 256
# it stages it through shared memory.)
MXFP4_BLOCK_K = 128
# A jitted function reads only constexpr globals.
_BLOCK_K = tl.constexpr(MXFP4_BLOCK_K)
_SCALE_EXP_OFFSET = tl.constexpr(ASM_SCALE_EXP_OFFSET)
_SCALE_MAX_BYTE = tl.constexpr(ASM_SCALE_MAX_BYTE)


def e2m1_word_ptx() -> str:
    """The inline PTX: ``$8`` one word of eight packed E2M1 values, ``$9`` the bf16x2 multiplier;
    ``$0..$7`` the eight bf16 results (element i of the word in ``$i``)."""
    lines = ["{", ".reg .b32 m, u, t;", "shr.b32 u, $8, 8;"]
    for shift, mask, mult, lo, hi in E2M1_WORD_PAIRS:
        src = "u" if shift else "$8"
        lines += [
            f"and.b32 m, {src}, {mask:#010x};",
            f"mul.lo.u32 t, m, {mult:#x};",
            f"and.b32 t, t, {BF16_E2M1_BITS:#010x};",
            "mul.rn.bf16x2 t, t, $9;",
            f"mov.b32 {{${lo}, ${hi}}}, t;",
        ]
    lines.append("}")
    return "\n".join(lines)


E2M1_WORD_ASM = tl.constexpr(e2m1_word_ptx())


@triton.jit
def to_dot_order(v, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[ROWS, BLOCK_K]`` in physical K order -> the tile's dot order (module docstring)."""
    # physical p = q*BK/4 + 8*cc + 4t + 2*c0 + h  ->  logical (cc, c0, h, q, t)
    v = v.reshape(ROWS, 4, BLOCK_K // 32, 2, 2, 2)
    return v.permute(0, 2, 4, 5, 1, 3).reshape(ROWS, BLOCK_K)


@triton.jit
def dot_order_position(p, BLOCK_K: tl.constexpr):
    """Where physical column ``p`` of a dot-ordered copy goes (tiles of ``BLOCK_K`` columns)."""
    tile = p // BLOCK_K
    r = p % BLOCK_K
    q = r // (BLOCK_K // 4)
    w = r % (BLOCK_K // 4)
    cc = w // 8
    t = (w >> 2) & 1
    c0 = (w >> 1) & 1
    h = w & 1
    return tile * BLOCK_K + 32 * cc + 16 * c0 + 8 * h + 2 * q + t


@triton.jit
def e2m1_f32(code):
    """int32 4-bit E2M1 codes -> their fp32 values (bit construction: exact)."""
    mag = code & 7
    normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)
    bits = tl.where(mag >= 2, normal, tl.where(mag == 1, 126 << 23, 0))
    bits = bits | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_tile(words, scale_bytes, ROWS: tl.constexpr, DTYPE: tl.constexpr):
    """Portable path: int32 words [ROWS, 16] and their UE8M0 bytes [ROWS, 16] -> the values
    [ROWS, 128] in physical K order, ``DTYPE`` (no offset)."""
    codes = (words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 0xF
    scale = (scale_bytes << 23).to(tl.float32, bitcast=True)  # 2**(s-127); s = 0 flushes to 0
    values = e2m1_f32(codes) * scale[:, :, None]
    return values.to(DTYPE).reshape(ROWS, _BLOCK_K)


@triton.jit
def e2m1_values_asm(words, scale_bytes):
    """Fast path (bf16, inline PTX): the same eight values times 2**-62 (module docstring)."""
    mult = (tl.minimum(scale_bytes, _SCALE_MAX_BYTE) + _SCALE_EXP_OFFSET) << 7
    mult = mult * 0x10001  # the bf16 multiplier in both halves
    return tl.inline_asm_elementwise(
        E2M1_WORD_ASM,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        [words, mult],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def word_scale_bytes(scale_words, ROWS: tl.constexpr):
    """The UE8M0 byte of each data word of a tile: ``scale_words`` int32 [ROWS] (each row's word
    of four scales covering the tile's 128 values of K) -> int32 [ROWS, 16]."""
    groups = (scale_words[:, None] >> (8 * tl.arange(0, 4))[None, :]) & 0xFF
    return tl.broadcast_to(groups[:, :, None], (ROWS, 4, 4)).reshape(ROWS, 16)


@triton.jit
def words_to_dot_order(e0, e1, e2, e3, e4, e5, e6, e7, ROWS: tl.constexpr):
    """Element i of every word of a tile (eight [ROWS, 16] tensors) -> the tile [ROWS, 128] in
    dot order."""
    # [R, W, t, h, c0] holding element 4t + 2*c0 + h of each word (joins append the last dim;
    # (e_i, e_i+4) first: the pairs the word trick leaves in one register)
    lo = tl.join(tl.join(e0, e4), tl.join(e1, e5))
    hi = tl.join(tl.join(e2, e6), tl.join(e3, e7))
    v = tl.join(lo, hi).reshape(ROWS, 4, 4, 2, 2, 2)  # word w = q * 4 + cc
    return v.permute(0, 2, 5, 4, 1, 3).reshape(ROWS, _BLOCK_K)  # (cc, c0, h, q, t)


@triton.jit
def weight_tile(words, scale_words, ROWS: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """A loaded MXFP4 tile of 128 values of K (``words`` int32 [ROWS, 16], ``scale_words`` int32
    [ROWS]) -> the MMA left operand [ROWS, 128] in dot order (times 2**-62 with ``ASM``)."""
    sb = word_scale_bytes(scale_words, ROWS)
    if ASM:
        e0, e1, e2, e3, e4, e5, e6, e7 = e2m1_values_asm(words, sb)
        v = words_to_dot_order(e0, e1, e2, e3, e4, e5, e6, e7, ROWS)
    else:
        v = to_dot_order(e2m1_tile(words, sb, ROWS, DTYPE), ROWS, _BLOCK_K)
    return v
