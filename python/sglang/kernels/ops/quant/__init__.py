"""Quantisation kernels (FP8 block scales)."""

from __future__ import annotations

from sglang.kernels.ops.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    block_dequant_fp8,
    block_quant_weight_fp8,
    per_token_group_quant_fp8,
)

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "block_dequant_fp8",
    "block_quant_weight_fp8",
    "per_token_group_quant_fp8",
]
