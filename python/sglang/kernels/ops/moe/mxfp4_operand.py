"""MXFP4 weight tiles dequantised in registers straight into the MMA's operand layout.

The W4A16 GEMMs (``fused_moe_mxfp4.py``) compute ``W @ X^T``: the weight tile is the MMA's left
operand ``[rows, BLOCK_K]`` (BLOCK_K = 128: 64 packed bytes and four UE8M0 scale bytes a row) and
the activations its right operand.

**Dot order.** The MMA's left-operand fragment gives a thread, per row and per 16-wide K step
``c``, the values ``k = 16c + 2q + t`` and ``16c + 8 + 2q + t`` (``q`` the lane within its quad,
``t`` in {0, 1}). The sum over K does not care which K is which as long as weights and activations
agree, so each tile's K is renumbered: logical ``kl = 16c + 8h + 2q + t`` holds the physical value

    p = q * BLOCK_K/4 + 8 * (c // 2) + 4t + 2 * (c % 2) + h,

i.e. byte ``p // 2`` of the row, low nibble for ``h = 0``. A thread's values are then the 32
contiguous physical values of its quad: 16 bytes (one vector load from shared memory) and one scale
group. The compiler keeps the dequantised values in the fragment's registers: nothing goes
between threads or through shared memory (checked on the TTGIR and SASS of Triton 3.6 and 3.9).
The activations go through the same renumbering (:func:`to_dot_order`, per tile or once for the
whole tensor ahead of the GEMM); GEMM 1 writes its output in GEMM 2's dot order
(:func:`dot_order_position`), so GEMM 2 reads it as it lies.

**Nibble trick** (the inline PTX, bf16 only): a byte permute spreads two packed bytes 16 bits
apart; then for the low (and the high) nibbles of both, one mask, one multiply (two shifts at once:
the magnitude bits to bf16 bits 6-8, the sign to bit 15) and one mask give two bf16 bit patterns
whose value is the E2M1 value times 2**-126 (exponent field = E2M1 exponent; the E2M1 subnormal
0.5 becomes the bf16 subnormal 2**-127, which the bf16 multiply keeps). One ``mul.bf16x2`` by
``2**(s - 63)`` (an exact power of two, a normal bf16 for any scale byte up to 190) then gives
``value * 2**(s-127) * 2**-62``: exact, and clear of bf16's subnormal range for scales down to
``2**-63``. The GEMMs multiply their fp32 accumulators by ``2**62`` (:data:`ASM_ACC_SCALE`).
About 2.3 instructions a weight value. The PTX is elementwise (each result depends on its own byte
and scale only), so it is right whichever elements the compiler hands one invocation.

The portable path (:func:`e2m1_nibbles`) computes the same values with plain Triton arithmetic
in fp32 (exact) and casts them to the operand dtype: fp16 activations and the interpreter use it;
everything else (loads, ordering, scales) is shared with the fast path.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.moe.mxfp4_weights import UTCCP_BLOCK, UTCCP_ROWS

# The inline PTX takes four packed bytes (one register) and spreads two of them 16 bits apart
# with a byte permute (selectors below: bytes 0 and 1, bytes 2 and 3), so that each nibble pair
# (mask, multiplier placing magnitude and sign) gives two bf16 values in one register: the low
# nibbles (even elements) of both bytes, then the high nibbles (odd elements).
E2M1_SPREAD_SELECTORS = (0x4140, 0x4342)
E2M1_NIBBLE_PAIRS = (
    (0x000F000F, (1 << 6) + (1 << 12)),  # low nibbles: magnitude to bits 6-8, sign to bit 15
    (0x00F000F0, (1 << 2) + (1 << 8)),  # high nibbles
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
_ACC_SCALE = tl.constexpr(ASM_ACC_SCALE)


def e2m1_byte_ptx() -> str:
    """The inline PTX (``pack=4``): ``$4`` four packed bytes, ``$5``/``$6`` the bf16 multipliers
    of bytes 0-1 / 2-3; ``$0``/``$1`` the low-nibble values of bytes 0-1 / 2-3, ``$2``/``$3`` the
    high-nibble values. Elementwise: each output depends on its own byte and multiplier only."""
    lines = ["{", ".reg .b32 s0, s1, v;"]
    lines += [f"prmt.b32 s{i}, $4, 0, {sel:#06x};" for i, sel in enumerate(E2M1_SPREAD_SELECTORS)]
    for kind, (mask, mult) in enumerate(E2M1_NIBBLE_PAIRS):
        for spread in range(2):
            lines += [
                f"and.b32 v, s{spread}, {mask:#010x};",
                f"mul.lo.u32 v, v, {mult:#x};",
                f"and.b32 v, v, {BF16_E2M1_BITS:#010x};",
                f"mul.rn.bf16x2 ${2 * kind + spread}, v, ${5 + spread};",
            ]
    lines.append("}")
    return "\n".join(lines)


E2M1_BYTE_ASM = tl.constexpr(e2m1_byte_ptx())


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
def e2m1_nibbles(packed, scale_bytes, DTYPE: tl.constexpr):
    """Portable path: packed bytes (uint8) and their UE8M0 bytes (int32), same shape -> the values
    of the low and of the high nibbles, ``DTYPE`` (no offset)."""
    b = packed.to(tl.int32)
    scale = (scale_bytes << 23).to(tl.float32, bitcast=True)  # 2**(s-127); s = 0 flushes to 0
    lo = (e2m1_f32(b & 0xF) * scale).to(DTYPE)
    hi = (e2m1_f32(b >> 4) * scale).to(DTYPE)
    return lo, hi


@triton.jit
def scale_multiplier(scale_bytes):
    """UE8M0 bytes (int32) -> the fast path's bf16 multipliers ``2**(s - 63)``."""
    mult = (tl.minimum(scale_bytes, _SCALE_MAX_BYTE) + _SCALE_EXP_OFFSET) << 7
    return mult.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e2m1_nibbles_asm(packed, scale_bytes):
    """Fast path (bf16, inline PTX): the same values times 2**-62 (module docstring)."""
    return e2m1_nibbles_scaled(packed, scale_multiplier(scale_bytes))


@triton.jit
def e2m1_nibbles_scaled(packed, mult):
    """:func:`e2m1_nibbles_asm` with the multipliers (:func:`scale_multiplier`) already made, e.g.
    once per scale byte before they are broadcast over the tile."""
    return tl.inline_asm_elementwise(
        E2M1_BYTE_ASM,
        "=r,=r,=r,=r,r,r,r",
        [packed, mult],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def byte_scales(scales, ROWS: tl.constexpr):
    """The UE8M0 byte of each packed byte of a tile: ``scales`` [ROWS, 4] (each row's four scales
    of the tile's 128 values of K, uint8) -> int32 [ROWS, 64]."""
    groups = scales.to(tl.int32)
    return tl.broadcast_to(groups[:, :, None], (ROWS, 4, 16)).reshape(ROWS, 64)


@triton.jit
def nibbles_to_dot_order(lo, hi, ROWS: tl.constexpr):
    """Low- and high-nibble values of a tile's bytes ([ROWS, 64] each) -> the tile [ROWS, 128]
    in dot order."""
    # byte j = 16q + 4cc + 2t + c0 holds elements 2j (low nibble) and 2j + 1 (high)
    lo = lo.reshape(ROWS, 4, 4, 2, 2)
    hi = hi.reshape(ROWS, 4, 4, 2, 2)
    v = tl.join(lo, hi)  # (q, cc, t, c0, h)
    return v.permute(0, 2, 4, 5, 1, 3).reshape(ROWS, _BLOCK_K)  # (cc, c0, h, q, t)


@triton.jit
def weight_tile(packed, scales, ROWS: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """A loaded MXFP4 tile of 128 values of K (``packed`` uint8 [ROWS, 64], ``scales`` uint8
    [ROWS, 4]) -> the MMA left operand [ROWS, 128] in dot order (times 2**-62 with ``ASM``)."""
    sb = byte_scales(scales, ROWS)
    if ASM:
        lo, hi = e2m1_nibbles_asm(packed, sb)
    else:
        lo, hi = e2m1_nibbles(packed, sb, DTYPE)
    return nibbles_to_dot_order(lo, hi, ROWS)


@triton.jit
def hidden_row_tile(x_ptr, rows, stride_xm, BLOCK_M: tl.constexpr):
    # A reorder kernel's tile of the hidden states: BLOCK_M rows by 128 columns, the program's
    # (row block, K tile); also the rows (int64, [BLOCK_M, 1]), the columns and the row mask.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * _BLOCK_K + tl.arange(0, _BLOCK_K)
    ok = (offs_m < rows)[:, None]
    m = offs_m.to(tl.int64)[:, None]
    x = tl.load(x_ptr + m * stride_xm + offs_k[None, :], mask=ok, other=0.0)
    return x, m, offs_k, ok


@triton.jit
def weighted_by_topk(acc, topk_weights_ptr, rows, row_ok, ASM: tl.constexpr):
    # GEMM 2's [weight rows, routed rows] accumulator times each routed row's top-k weight (with
    # the fast path's weights, also undoing their 2**-62 scaling).
    weight = tl.load(topk_weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if ASM:
        weight = weight * _ACC_SCALE
    return acc * weight[None, :]


@triton.jit
def store_transposed(out_ptr, rows, cols, row_ok, stride_om, val):
    # A [cols, rows] tile into out [rows, cols] in out's dtype; padding rows are not written.
    out_ptrs = out_ptr + rows[None, :] * stride_om + cols[:, None]
    tl.store(out_ptrs, val.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])


def reorder_hidden_columns(kernel: Any, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``x`` [T, H] with every 128 columns moved into a GEMM's K order by ``kernel`` (a
    ``@triton.jit`` row-tile kernel taking ``x, out, rows, stride_x, stride_out, BLOCK_M``),
    written to ``out`` (new when None)."""
    rows, h = x.shape
    if h % MXFP4_BLOCK_K:
        raise ValueError(f"hidden size {h} is not a multiple of {MXFP4_BLOCK_K}")
    out = torch.empty_like(x) if out is None else out
    if rows:
        block_m = 16
        grid = (triton.cdiv(rows, block_m), h // MXFP4_BLOCK_K)
        kernel[grid](x, out, rows, x.stride(0), out.stride(0), BLOCK_M=block_m, num_warps=4)
    return out


_UTCCP_A = tl.constexpr(UTCCP_BLOCK[0])
_UTCCP_B = tl.constexpr(UTCCP_BLOCK[1])
_UTCCP_ROWS = tl.constexpr(UTCCP_ROWS)


@triton.jit
def stored_gate_up_rows(cols, up, n_cols, GRANULE: tl.constexpr):
    # The stored w13 row of gate (up = 0) or up (up = 1) column ``cols`` of I = n_cols:
    # ``[gate; up]`` halves (GRANULE 0), else runs of GRANULE gate rows, then the GRANULE up rows
    # of the same columns (``mxfp4_weights.gate_up_rows``).
    if GRANULE > 0:
        rows = (cols // GRANULE) * (2 * GRANULE) + cols % GRANULE + up * GRANULE
    else:
        rows = cols + up * n_cols
    return rows


@triton.jit
def stored_scale_rows(rows, UTCCP: tl.constexpr):
    # The stored row of each scale row (a 128-row block's row i*32 + j sits at j*4 + i).
    if UTCCP:
        within = rows % _UTCCP_ROWS
        rows = rows - within + (within % _UTCCP_B) * _UTCCP_A + within // _UTCCP_B
    return rows
