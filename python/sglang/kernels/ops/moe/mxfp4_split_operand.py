"""MXFP4 weight tiles as two MMA operands, the low and the high nibbles (the split kernel's
operands, ``mxfp4_split_gemm.py``).

A 128-wide K tile of a weight row is 64 packed bytes and four UE8M0 scales (one per 16 bytes). The
dot-order kernels (``mxfp4_operand.py``) build one operand ``[rows, 128]`` from it, which takes a
join and a permute of the dequantised values. The split kernel multiplies two ``[rows, 64]``
operands instead: the low nibbles (physical values ``2b``) and the high nibbles (``2b + 1``) of the
tile's bytes ``b``, each against the matching half of the activations. Each half is an elementwise
function of the packed bytes (the inline PTX of ``mxfp4_operand.py``, or its portable twin), so the
dequantised registers are the MMA operand as they come out: nothing is interleaved or staged
through shared memory.

**Split order.** Both halves renumber K the same way: index ``k = 16c + 4g + i`` (c, g, i in
0..3) holds byte ``16g + 4c + i``. Fed by 8-bit loads, an MMA lane holds four consecutive K of
every 16-wide step of a row (``4q .. 4q + 3`` for lane ``q`` of its quad), so with this order lane
``q`` holds bytes ``16q .. 16q + 15``: one 16-byte shared-memory load and one scale group, i.e. one
scale multiplier a row and lane instead of four (checked on the SASS of Triton 3.6 and 3.9). The
order is a permutation within each tile applied to weights and activations alike, so the result
does not depend on the layout the compiler picks. The activations take it as physical value
``p = 2b + h`` of a tile at position ``64h + 16c + 4g + i`` (:func:`split_order_position`):
GEMM 1 writes its output so, GEMM 2 reads it as it lies, and the hidden states are reordered per
tile (:func:`to_split_halves`) or once ahead of GEMM 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sglang.kernels.ops.moe.mxfp4_operand import (
    MXFP4_BLOCK_K,
    e2m1_nibbles,
    e2m1_nibbles_scaled,
    scale_multiplier,
)

HALF_K = MXFP4_BLOCK_K // 2  # K of each half: the tile's 64 bytes
_BK = tl.constexpr(MXFP4_BLOCK_K)
_HALF = tl.constexpr(HALF_K)


def split_order_position_host(p: int) -> int:
    """:func:`split_order_position` for one column, in Python (tests, tools)."""
    tile, r = divmod(p, MXFP4_BLOCK_K)
    b, h = divmod(r, 2)
    g, rest = divmod(b, 16)
    c, i = divmod(rest, 4)
    return tile * MXFP4_BLOCK_K + HALF_K * h + 16 * c + 4 * g + i


@triton.jit
def split_order_position(p):
    """Where physical column ``p`` of an activation row sits in the split order."""
    r = p % _BK
    b = r // 2
    return p - r + _HALF * (r % 2) + 16 * ((b // 4) % 4) + 4 * (b // 16) + b % 4


@triton.jit
def to_split_halves(a, ROWS: tl.constexpr):
    """An activation tile ``[ROWS, 128]`` in physical order -> its low and high halves
    ``[ROWS, 64]`` in split order."""
    # physical p = 32g + 8c + 2i + h  ->  (c, g, i) = k, h = half
    a = a.reshape(ROWS, 4, 4, 4, 2).permute(0, 2, 1, 3, 4).reshape(ROWS, _HALF, 2)
    return tl.split(a)


@triton.jit
def split_weight_halves(packed, words, ROWS: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """A loaded K tile of ``ROWS`` weight rows (``packed`` uint8 ``[ROWS, 64]`` as stored,
    ``words`` int32 ``[ROWS]``: the row's four UE8M0 bytes of the tile, the first group lowest) ->
    the low- and high-nibble operands ``[ROWS, 64]`` in split order (times 2**-62 with ``ASM``)."""
    p = packed.reshape(ROWS, 4, 4, 4).permute(0, 2, 1, 3).reshape(ROWS, _HALF)
    groups = (words[:, None] >> (8 * tl.arange(0, 4))[None, :]) & 0xFF  # [ROWS, 4]: group g
    if ASM:
        # one multiplier a scale byte, then broadcast over its 16 bytes
        mult = scale_multiplier(groups)
        mult = tl.broadcast_to(mult[:, None, :, None], (ROWS, 4, 4, 4)).reshape(ROWS, _HALF)
        lo, hi = e2m1_nibbles_scaled(p, mult)
    else:
        sb = tl.broadcast_to(groups[:, None, :, None], (ROWS, 4, 4, 4)).reshape(ROWS, _HALF)
        lo, hi = e2m1_nibbles(p, sb, DTYPE)
    return lo, hi
