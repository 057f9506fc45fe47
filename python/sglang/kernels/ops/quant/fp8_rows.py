"""FP8 KV rows: one cached row (a DeepSeek V4 compressed entry or indexer key, a Kimi K3 MLA latent)
as e4m3 values with power-of-two group scales, packed in bytes.

A row of ``dim`` values whose last ``rope`` values stay bf16 (positional dims, the most sensitive
to rounding) is stored as::

    [ e4m3 values (F bytes) | bf16 tail (2 * rope bytes) | UE8M0 scales (F / G bytes) | pad ]

with ``F = dim - rope`` quantised values in groups of ``G`` (the largest power of two dividing
``F``, at most 64), one scale ``2^k`` a group stored as the byte ``k + 127`` (UE8M0), and the row
padded to 8 bytes. ``k`` is the least exponent with ``amax <= 448 * 2^k`` (read off amax's bits,
so every implementation agrees), clamped to ``[K_MIN, K_MAX]``. Sizes: DeepSeek V4's entry (512,
rope 64) 448 + 128 + 7 + 1 pad = 584 bytes (FlashMLA's V4 layout); its indexer key (128, no bf16
tail: DeepSeek quantises all of it) 128 + 2 + 6 pad = 136; Kimi K3's latent (512 + 64 rope)
512 + 128 + 8 = 648.

Why power-of-two scales: ``x / 2^k`` and ``q * 2^k`` are exact, and an e4m3 value (4 significant
bits) times ``2^k`` is a bf16 value, so a dequantised row is exactly representable in bf16. The
attention kernels therefore dequantise into the same bf16 tensor-core products they run on bf16
caches and stay exact against a torch reference on the same bits; a per-token fp32 scale would
break that (the products would need fp32 or split operands). Accuracy: e4m3 is a floating format,
so a value's relative error is at most 2^-4 whatever the scale, down to ``amax / 2^15`` of its
group; the scale's granularity (a power of two, per 64 values) matters only below that.

The torch functions (:meth:`Fp8RowFormat.quantize`, :meth:`Fp8RowFormat.dequantize`) are the
reference and the CPU path; the Triton helpers below are what the kernels use to write rows
(:func:`encode_e4m3`, :func:`group_exponents`) and read them (:func:`load_rows`). The Triton
encoder rounds to nearest even with integer operations (no hardware FP8 conversion: the
interpreter's is wrong and older GPUs have none), bit-identical to torch's cast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
MAX_GROUP = 64
ROW_ALIGN = 8
# Group exponents: x * 2^-k and q * 2^(k + 8) stay normal fp32 numbers, and an fp32-subnormal x
# (below 2^-126) always quantises to 0 (x * 2^-K_MIN < 2^-10, under half the least e4m3 value).
K_MIN = -116
K_MAX = 119
_UE8M0_BIAS = 127
# The same bounds as the kernels read them (a jit function reads constexpr globals only).
_K_MIN_C = tl.constexpr(K_MIN)
_K_MAX_C = tl.constexpr(K_MAX)


@dataclass(frozen=True)
class Fp8RowFormat:
    """The byte layout of one FP8 row of ``dim`` values, the last ``rope`` of them bf16."""

    dim: int
    rope: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rope < self.dim:
            raise ValueError(
                f"an FP8 row needs 0 <= rope < dim, got dim {self.dim}, rope {self.rope}"
            )
        if self.fp8_dims % 2:
            raise ValueError(f"an FP8 row needs an even number of e4m3 values, got {self.fp8_dims}")

    @property
    def fp8_dims(self) -> int:
        """Values stored as e4m3 (the first ``dim - rope``)."""
        return self.dim - self.rope

    @property
    def group(self) -> int:
        """Values a scale covers: the largest power of two dividing :attr:`fp8_dims`, <= 64."""
        return math.gcd(self.fp8_dims, MAX_GROUP)

    @property
    def num_scales(self) -> int:
        return self.fp8_dims // self.group

    @property
    def rope_offset(self) -> int:
        """Byte offset of the bf16 tail (even: the e4m3 part is)."""
        return self.fp8_dims

    @property
    def scale_offset(self) -> int:
        return self.rope_offset + 2 * self.rope

    @property
    def row_bytes(self) -> int:
        return -(-(self.scale_offset + self.num_scales) // ROW_ALIGN) * ROW_ALIGN

    def describe(self) -> str:
        parts = [f"{self.fp8_dims} e4m3"]
        if self.rope:
            parts.append(f"{self.rope} bf16")
        parts.append(f"{self.num_scales} UE8M0 scales (one per {self.group})")
        return " + ".join(parts) + f" = {self.row_bytes} B"

    # --- torch reference ----------------------------------------------------------------------

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` (any float dtype) -> the rows ``[..., row_bytes]`` uint8."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"FP8 rows of {self.dim} values, got a last dim of {x.shape[-1]}")
        lead = x.shape[:-1]
        xf = x.float().reshape(-1, self.dim)
        f, g = self.fp8_dims, self.group
        groups = xf[:, :f].reshape(-1, self.num_scales, g)
        k = group_exponent_torch(groups.abs().amax(dim=-1))  # [n, groups] int32
        q = groups * torch.ldexp(torch.ones_like(k, dtype=torch.float32), -k)[..., None]
        codes = q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, f)
        out = torch.zeros(xf.shape[0], self.row_bytes, dtype=torch.uint8, device=x.device)
        out[:, :f] = codes
        if self.rope:
            tail = xf[:, f:].to(torch.bfloat16).contiguous().view(torch.uint8)
            out[:, self.rope_offset : self.scale_offset] = tail
        out[:, self.scale_offset : self.scale_offset + self.num_scales] = (k + _UE8M0_BIAS).to(
            torch.uint8
        )
        return out.view(*lead, self.row_bytes)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``rows [..., row_bytes]`` uint8 -> ``[..., dim]`` values in ``dtype`` (exact in fp32
        and bf16)."""
        if rows.dtype != torch.uint8 or rows.shape[-1] != self.row_bytes:
            raise ValueError(
                f"FP8 rows are uint8 [..., {self.row_bytes}], got {rows.dtype} {tuple(rows.shape)}"
            )
        lead = rows.shape[:-1]
        r = rows.reshape(-1, self.row_bytes)
        f, g = self.fp8_dims, self.group
        codes = r[:, :f].contiguous().view(torch.float8_e4m3fn).float()
        k = r[:, self.scale_offset : self.scale_offset + self.num_scales].int() - _UE8M0_BIAS
        scale = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k)
        vals = (codes.view(-1, self.num_scales, g) * scale[..., None]).reshape(-1, f)
        if self.rope:
            tail = r[:, self.rope_offset : self.scale_offset].contiguous().view(torch.bfloat16)
            vals = torch.cat([vals, tail.float()], dim=-1)
        return vals.to(dtype).view(*lead, self.dim)


def group_exponent_torch(amax: torch.Tensor) -> torch.Tensor:
    """The scale exponents ``k`` of groups with absolute maxima ``amax`` (fp32, >= 0): the least
    ``k`` with ``amax <= 448 * 2^k``, clamped to ``[K_MIN, K_MAX]`` (int32)."""
    bits = amax.float().contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    # 448 = 1.75 * 2^8: amax = 1.f * 2^e fits 2^(e - 8) when 1.f <= 1.75 (fraction <= 0x600000)
    k = e - 8 + ((bits & 0x7FFFFF) > 0x600000).int()
    return k.clamp(K_MIN, K_MAX).int()


# --- Triton helpers -----------------------------------------------------------------------------


@triton.jit
def pow2(k):
    """``2^k`` as fp32 for int32 ``k`` in [-126, 127] (built from its bits: exact)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def group_exponent(amax):
    """:func:`group_exponent_torch` for fp32 ``amax >= 0`` (int32, same bits arithmetic)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    k = e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.minimum(tl.maximum(k, _K_MIN_C), _K_MAX_C)


@triton.jit
def encode_e4m3(y):
    """fp32 ``y`` -> its e4m3fn code (int32 in 0..255): round to nearest even, saturating at
    448 (``|y| <= 448`` here: the scales see to it), NaN to 0x7F; torch's cast, bit for bit."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    big_e = mag >> 23
    frac = mag & 0x7FFFFF
    # normal e4m3 (|y| >= 2^-6, fp32 exponent >= 121): 3 fraction bits, rounded on the other 20
    head = frac >> 20
    rest = frac & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((head & 1) == 1))
    normal = ((big_e - 120) << 3) + head + up.to(tl.int32)
    # subnormal e4m3 (multiples of 2^-9): round the significand scaled by 2^(E - 141)
    shift = tl.minimum(141 - big_e, 30)
    sig = frac | 0x800000
    low = sig >> shift
    dropped = sig & ((1 << shift) - 1)
    halfway = 1 << (shift - 1)
    sub_up = (dropped > halfway) | ((dropped == halfway) & ((low & 1) == 1))
    sub = low + sub_up.to(tl.int32)
    code = tl.where(big_e >= 121, normal, sub)
    code = tl.minimum(code, 0x7E)
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return code | sign


@triton.jit
def bf16_bits(v):
    """fp32 ``v`` rounded to bf16 (nearest even; NaN stays NaN), as the int16 bit pattern: the
    same rounding as torch's cast on every backend (the interpreter's own cast truncates)."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, (bits >> 16) | 0x40, rounded).to(tl.int16)


@triton.jit
def group_exponents(v, col, F: tl.constexpr, G: tl.constexpr, NG: tl.constexpr):
    """Per scale group ``g < NG`` (a power of two >= the row's group count) of the values ``v``
    at row columns ``col`` (same shape, 1-D; columns >= F are the bf16 tail): the greatest
    ``|v|``, as ``[NG]`` fp32 (0 for groups with no value here). Combine partial maxima (e.g.
    even and odd columns) with ``maximum`` before :func:`group_exponent`."""
    grp = tl.arange(0, NG)
    own = ((col // G)[None, :] == grp[:, None]) & (col < F)[None, :]
    return tl.max(tl.where(own, tl.abs(v)[None, :], 0.0), axis=1)


@triton.jit
def column_exponents(k_groups, col, G: tl.constexpr, NG: tl.constexpr):
    """The group exponents ``k_groups [NG]`` spread to the columns ``col`` (1-D)."""
    grp = tl.arange(0, NG)
    return tl.sum(tl.where((col // G)[None, :] == grp[:, None], k_groups[:, None], 0), axis=0)


@triton.jit
def store_row(
    row_ptr, v, col, k_groups,
    F: tl.constexpr, ROPE: tl.constexpr, ROPE_OFF: tl.constexpr, G: tl.constexpr,
    NG: tl.constexpr,
):  # fmt: skip
    """Write values ``v`` (fp32, 1-D) at columns ``col`` of the FP8 row at ``row_ptr`` (uint8):
    e4m3 codes scaled by their group's ``2^-k`` for ``col < F``, bf16 for the tail. The group
    exponents (``k_groups [NG]``, from every column of the row) are written by
    :func:`store_scales`, once a row."""
    is8 = col < F
    k = column_exponents(k_groups, col, G, NG)
    code = encode_e4m3(v * pow2(-k))
    tl.store(row_ptr + col, code.to(tl.uint8), mask=is8)
    if ROPE > 0:
        tail = (row_ptr + ROPE_OFF).to(tl.pointer_type(tl.int16))
        tl.store(tail + (col - F), bf16_bits(v), mask=(col >= F) & (col < F + ROPE))


@triton.jit
def store_scales(
    row_ptr, k_groups, SCALE_OFF: tl.constexpr, NG: tl.constexpr, NUM_SCALES: tl.constexpr
):
    """The row's group exponents as UE8M0 bytes (``k + 127``)."""
    grp = tl.arange(0, NG)
    tl.store(row_ptr + SCALE_OFF + grp, (k_groups + 127).to(tl.uint8), mask=grp < NUM_SCALES)


@triton.jit
def e4m3_bits_to_f32(code):
    """e4m3 codes (uint8) -> their values times ``2^-8``, fp32, exactly: the code's bits placed in
    an fp16 (same 3 fraction bits, exponent bias 15 instead of 7: subnormals included)."""
    c = code.to(tl.int16)
    half = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    return half.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_rows(
    base_ptr, row_off, live,
    COL0: tl.constexpr, C: tl.constexpr, F: tl.constexpr, ROPE: tl.constexpr,
    ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    """Columns ``COL0 .. COL0 + C`` of the FP8 rows at byte offsets ``row_off [N]`` (int64) from
    ``base_ptr`` (uint8), rows where ``live [N]`` (else 0) -> fp32 ``[N, C]``, exact (and exact
    in bf16). ``COL0`` is a multiple of the group ``G`` (so is ``C`` where it covers e4m3
    columns): each group's scale is loaded once a row and applied to its ``G`` columns."""
    cols = COL0 + tl.arange(0, C)
    addr = base_ptr + row_off[:, None]
    if COL0 >= F:  # the bf16 tail only
        tail = (base_ptr + ROPE_OFF).to(tl.pointer_type(tl.bfloat16))
        m = live[:, None] & (cols < F + ROPE)[None, :]
        r = tl.load(tail + (row_off // 2)[:, None] + (cols - F)[None, :], mask=m, other=0.0)
        v = r.to(tl.float32)
    else:  # one branch a call: Triton traces code after an early return too (a tail of fewer
        # than G columns would make the group count 0 there)
        is8 = cols < F
        code = tl.load(addr + cols[None, :], mask=live[:, None] & is8[None, :], other=0)
        n: tl.constexpr = code.shape[0]
        ng: tl.constexpr = C // G
        grp = COL0 // G + tl.arange(0, ng)
        # masked lanes read the scale 2^0: a defined factor for their zero codes (never inf * 0)
        kb = tl.load(
            addr + SCALE_OFF + grp[None, :], mask=live[:, None] & (grp * G < F)[None, :], other=127
        )
        scale = pow2(kb.to(tl.int32) - 127 + 8)  # the codes' fp16 reading is 2^-8 of their value
        v = tl.reshape(tl.reshape(e4m3_bits_to_f32(code), [n, ng, G]) * scale[:, :, None], [n, C])
        if COL0 + C > F:  # these columns reach the bf16 tail
            tail = (base_ptr + ROPE_OFF).to(tl.pointer_type(tl.bfloat16))
            m = live[:, None] & (~is8 & (cols < F + ROPE))[None, :]
            r = tl.load(tail + (row_off // 2)[:, None] + (cols - F)[None, :], mask=m, other=0.0)
            v = tl.where(is8[None, :], v, r.to(tl.float32))
    return v


def fp8_constexprs(fmt: Fp8RowFormat | None) -> dict[str, int | bool]:
    """The compile-time arguments every kernel that reads or writes FP8 rows declares
    (``FP8``, ``FP8_F``, ``FP8_ROPE``, ``FP8_ROPE_OFF``, ``FP8_SCALE_OFF``, ``FP8_G``,
    ``FP8_NG``, ``FP8_SCALES``, ``FP8_ROW``); ``fmt`` None: plain rows (``FP8`` False, the rest
    placeholders)."""
    if fmt is None:
        return {
            "FP8": False, "FP8_F": 2, "FP8_ROPE": 0, "FP8_ROPE_OFF": 0, "FP8_SCALE_OFF": 0,
            "FP8_G": 2, "FP8_NG": 1, "FP8_SCALES": 1, "FP8_ROW": 8,
        }  # fmt: skip
    return {
        "FP8": True,
        "FP8_F": fmt.fp8_dims,
        "FP8_ROPE": fmt.rope,
        "FP8_ROPE_OFF": fmt.rope_offset,
        "FP8_SCALE_OFF": fmt.scale_offset,
        "FP8_G": fmt.group,
        "FP8_NG": triton.next_power_of_2(fmt.num_scales),
        "FP8_SCALES": fmt.num_scales,
        "FP8_ROW": fmt.row_bytes,
    }


def fp8_rows_reason(rows: torch.Tensor, fmt: Fp8RowFormat) -> str | None:
    """Why ``rows`` is not a store of contiguous FP8 rows of ``fmt`` (None: it is)."""
    if rows.dtype != torch.uint8 or rows.shape[-1] != fmt.row_bytes:
        return (
            f"FP8 rows of {fmt.row_bytes} bytes are uint8 [..., {fmt.row_bytes}], got "
            f"{rows.dtype} {tuple(rows.shape)}"
        )
    if rows.stride(-1) != 1 or (rows.dim() > 1 and rows.stride(-2) != fmt.row_bytes):
        return "FP8 rows must be contiguous"
    return None
