"""The quantised formats the releases ship, as the writers produce them:

- FP8 block: e4m3 weights with one power-of-two scale per 128x128 tile (DeepSeek V4's dense
  weights). The scale is the smallest power of two with ``amax / scale <= 448``, so every tile
  uses the e4m3 range and ``q * scale`` is the exact value the checkpoint stands for. Stored as
  UE8M0 (``float8_e8m0fnu``: the exponent byte ``log2(scale) + 127``) or as fp32.
- MXFP4: two E2M1 values a byte (low nibble = even element), one UE8M0 byte per 32 values
  (``sglang.srt.layers.quantization.mxfp4``), quantised a slab of rows at a time so a real-width
  expert stack fits in GPU memory.
"""

from __future__ import annotations

import torch

from sglang.kernels.ops.quant.fp8 import FP8_DTYPE, FP8_MAX, block_dequant_fp8
from sglang.srt.layers.quantization.mxfp4 import UE8M0_BIAS, dequant_mxfp4, quant_mxfp4

FP8_BLOCK = 128
# MXFP4 quantisation keeps ~8 fp32 temporaries per element (distance to each E2M1 magnitude):
# quantise at most this many elements at once.
MXFP4_CHUNK_ELEMENTS = 1 << 26


def pow2_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Powers of two (fp32) -> their UE8M0 bytes as ``float8_e8m0fnu`` (the bytes are built from
    the exponent, not by a value cast)."""
    exponent = torch.log2(scale.float()).round()
    return (exponent + UE8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def quant_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., N, K] -> (e4m3 [..., N, K], fp32 powers of two [..., ceil(N/b), ceil(K/b)]).

    Partial edge tiles get their own scale; an all-zero tile gets scale 2^-127 (not 0)."""
    n, k = w.shape[-2], w.shape[-1]
    nb, kb = -(-n // block), -(-k // block)
    lead = w.shape[:-2]
    padded = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    tiles = padded.view(*lead, nb, block, kb, block)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp_min(2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-UE8M0_BIAS, UE8M0_BIAS))
    q = (tiles / scale[..., :, None, :, None]).to(FP8_DTYPE)
    return q.view(*lead, nb * block, kb * block)[..., :n, :k].contiguous(), scale


def dequant_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """e4m3 [..., N, K] times its tile scales (fp32 or UE8M0: any dtype holding the value)."""
    return block_dequant_fp8(q, scale.float(), (block, block), dtype=torch.float32)


def quant_mxfp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., K] -> (packed uint8 [..., K/2], UE8M0 bytes uint8 [..., K/32]), through
    :func:`quant_mxfp4` a slab of rows at a time."""
    k = w.shape[-1]
    rows = w.reshape(-1, k)
    step = max(1, MXFP4_CHUNK_ELEMENTS // k)
    parts = [quant_mxfp4(rows[i : i + step]) for i in range(0, rows.shape[0], step)]
    packed = torch.cat([p for p, _ in parts])
    scales = torch.cat([s for _, s in parts])
    return packed.view(*w.shape[:-1], k // 2), scales.view(*w.shape[:-1], scales.shape[-1])


def dequant_mxfp4_rows(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Packed MXFP4 (uint8 / int8 bytes) with UE8M0 scales (uint8 / ``float8_e8m0fnu``) -> fp32."""
    return dequant_mxfp4(packed.view(torch.uint8), scales.view(torch.uint8), torch.float32)
