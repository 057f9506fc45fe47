"""Fused-MoE kernels: expert alignment and the two grouped GEMMs (bf16 and FP8 block scales)."""

from __future__ import annotations

from sglang.kernels.ops.moe.align import moe_align_block_size, moe_align_block_size_torch
from sglang.kernels.ops.moe.fused_moe import (
    FusedMoeConfig,
    GemmTile,
    fused_experts,
    fused_experts_torch,
    get_config,
)

__all__ = [
    "FusedMoeConfig",
    "GemmTile",
    "fused_experts",
    "fused_experts_torch",
    "get_config",
    "moe_align_block_size",
    "moe_align_block_size_torch",
]
