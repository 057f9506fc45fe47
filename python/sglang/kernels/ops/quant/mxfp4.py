"""MXFP4 weights: two FP4 (E2M1) values a byte, one UE8M0 (power-of-two) scale per 32 values.

Byte layout: element ``2j`` is the low nibble and ``2j+1`` the high nibble of byte ``j``; bit 3 of a
nibble is the sign, bits 0-2 index the E2M1 magnitudes below (bits 1-2 the exponent ``e``, bit 0
the mantissa ``m``: ``2**(e-1) * (1 + m/2)``, and ``m/2`` when ``e`` is 0). A UE8M0 scale byte
``s`` means ``2 ** (s - 127)``.

The format facts live here, below both the Triton kernels (``kernels/ops/moe/fused_moe_mxfp4.py``)
and the engine's loaders (``srt/layers/quantization/mxfp4.py`` re-exports them); the torch
functions are the reference unpack / dequantise / quantise (load time, tests, oracles).
"""

from __future__ import annotations

import torch

MXFP4_GROUP = 32
# Packed FP4 bytes may arrive as uint8 or int8 (checkpoints and DeepGEMM differ): the same bits.
MXFP4_DTYPES = (torch.uint8, torch.int8)
# A UE8M0 byte ``s`` is the power of two ``2 ** (s - UE8M0_BIAS)``.
UE8M0_BIAS = 127
# UE8M0 scales may be stored as raw bytes or as torch's e8m0 dtype: the same bits.
UE8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 [16]: the value of each 4-bit code (codes 8-15 are the negatives of 0-7)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def ue8m0_to_float(sf_bytes: torch.Tensor) -> torch.Tensor:
    """UE8M0 exponent bytes (uint8) -> fp32 powers of two.

    The bytes are converted by value, so a caller holding int8 or float8_e8m0fnu scales views
    them as uint8 first (a value cast of either would not give the exponent byte)."""
    return torch.exp2(sf_bytes.to(torch.float32) - UE8M0_BIAS)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> float32 [..., K] E2M1 values (unscaled)."""
    if packed.dtype not in MXFP4_DTYPES:
        raise TypeError(f"MXFP4 weights must be uint8/int8 packed bytes, got {packed.dtype}")
    raw = packed.view(torch.uint8)
    low, high = (raw & 0x0F).long(), (raw >> 4).long()
    codes = torch.stack([low, high], dim=-1).flatten(-2)
    return e2m1_table(packed.device)[codes]


# Rows are dequantised in pieces of about this many values: the int64 codes and fp32 values of a
# whole expert stack (Kimi K3's 384 experts: 8.5G values) would need hundreds of GiB at once.
DEQUANT_CHUNK_VALUES = 1 << 24


def dequant_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Packed FP4 [..., K/2] with UE8M0 scales [..., K/32] -> ``dtype`` [..., K]."""
    if packed.dtype not in MXFP4_DTYPES:
        raise TypeError(f"MXFP4 weights must be uint8/int8 packed bytes, got {packed.dtype}")
    k = 2 * packed.shape[-1]
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * MXFP4_GROUP != k:
        raise ValueError(
            f"MXFP4 scales of shape {tuple(scales.shape)} do not match {k} values a row "
            f"(one scale per {MXFP4_GROUP}) for packed weights of shape {tuple(packed.shape)}"
        )
    out = torch.empty(*packed.shape[:-1], k, dtype=dtype, device=packed.device)
    if out.numel() == 0:
        return out
    rows_out, rows_w = out.view(-1, k), packed.reshape(-1, k // 2)
    rows_s = scales.view(torch.uint8).reshape(-1, scales.shape[-1])
    step = max(1, DEQUANT_CHUNK_VALUES // k)
    for r in range(0, rows_out.shape[0], step):
        factor = ue8m0_to_float(rows_s[r : r + step]).repeat_interleave(MXFP4_GROUP, dim=-1)
        rows_out[r : r + step] = unpack_fp4(rows_w[r : r + step]) * factor
    return out


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., K] -> (packed uint8 [..., K/2], UE8M0 scales uint8 [..., K/32]).

    Round-to-nearest onto the E2M1 grid, scale = smallest power of two with amax/scale <= 6.
    Used to make test checkpoints and by tests; not a hot path."""
    k = w.shape[-1]
    if k % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the last dim divisible by {MXFP4_GROUP}, got {k}")
    groups = w.float().unflatten(-1, (k // MXFP4_GROUP, MXFP4_GROUP))
    amax = groups.abs().amax(-1).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    mags = torch.tensor(E2M1_MAGNITUDES, device=w.device)
    code = (scaled.abs().unsqueeze(-1) - mags).abs().argmin(-1)
    code = code + 8 * (scaled < 0).long() * (code > 0).long()
    code = code.flatten(-2).to(torch.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, (exponent + UE8M0_BIAS).to(torch.uint8)
