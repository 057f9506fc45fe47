"""Fused-MoE kernels: expert alignment and the two grouped GEMMs (bf16 and FP8 block scales), and
the W4A16 variant on MXFP4 experts."""

from __future__ import annotations

from sglang.kernels.ops.moe.align import moe_align_block_size, moe_align_block_size_torch
from sglang.kernels.ops.moe.fused_moe import (
    FusedMoeConfig,
    GemmTile,
    fused_experts,
    fused_experts_torch,
    get_config,
)
from sglang.kernels.ops.moe.fused_moe_mxfp4 import (
    fused_experts_mxfp4,
    fused_experts_mxfp4_torch,
    fused_experts_mxfp4_weights,
)
from sglang.kernels.ops.moe.mxfp4_config import Mxfp4GemmTile, Mxfp4MoeConfig
from sglang.kernels.ops.moe.mxfp4_weights import (
    MEGA_MOE_LAYOUT,
    PLAIN_LAYOUT,
    Mxfp4Layout,
    Mxfp4MoeWeights,
    mega_moe_mxfp4_weights,
    prepare_mxfp4_moe_weights,
)

__all__ = [
    "MEGA_MOE_LAYOUT",
    "PLAIN_LAYOUT",
    "FusedMoeConfig",
    "GemmTile",
    "Mxfp4GemmTile",
    "Mxfp4Layout",
    "Mxfp4MoeConfig",
    "Mxfp4MoeWeights",
    "fused_experts",
    "fused_experts_mxfp4",
    "fused_experts_mxfp4_torch",
    "fused_experts_mxfp4_weights",
    "fused_experts_torch",
    "get_config",
    "mega_moe_mxfp4_weights",
    "moe_align_block_size",
    "moe_align_block_size_torch",
    "prepare_mxfp4_moe_weights",
]
