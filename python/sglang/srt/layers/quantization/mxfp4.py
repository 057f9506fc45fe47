"""MXFP4 weights: two FP4 (E2M1) values a byte, one UE8M0 (power-of-two) scale per 32 values.

The format facts and the reference unpack / dequantise / quantise are owned by
``sglang.kernels.ops.quant.mxfp4`` (below both the kernels and the engine); this module re-exports
them under the engine's import path.
"""

from __future__ import annotations

from sglang.kernels.ops.quant.mxfp4 import (
    E2M1_MAGNITUDES,
    MXFP4_DTYPES,
    MXFP4_GROUP,
    UE8M0_BIAS,
    UE8M0_DTYPES,
    dequant_mxfp4,
    quant_mxfp4,
    ue8m0_to_float,
    unpack_fp4,
)

__all__ = [
    "E2M1_MAGNITUDES",
    "MXFP4_DTYPES",
    "MXFP4_GROUP",
    "UE8M0_BIAS",
    "UE8M0_DTYPES",
    "dequant_mxfp4",
    "quant_mxfp4",
    "ue8m0_to_float",
    "unpack_fp4",
]
