"""Tile configurations of the two-launch fused MoE (``fused_moe.py``): the default rule by rows
per expert. A leaf, so the tuned-table lookup (``tuned_configs.py``) and the kernels both read
it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.kernels.ops.quant.fp8 import FP8_DTYPE


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class FusedMoeConfig:
    """``block_m`` is shared by both GEMMs (it is the alignment of the sorted rows)."""

    block_m: int
    gemm1: GemmTile
    gemm2: GemmTile


def get_config(
    M: int, E: int, H: int, I: int, dtype: torch.dtype, *, top_k: int = 8
) -> FusedMoeConfig:
    """Tiles for ``M`` tokens, ``E`` experts, hidden ``H``, expert width ``I`` and weight
    ``dtype`` (bf16/fp16 or float8_e4m3fn), chosen for Hopper (228 KB shared memory an SM).

    The deciding quantity is the average rows an expert gets, ``M*top_k/E``: few rows (decode)
    means the GEMMs stream weights, so tiles stay short in M with deep K pipelines; many rows
    (prefill) means compute-bound, so tiles grow (bf16: 128 rows on 8 warps; FP8: 64 rows, see
    below). Gate and up share a tile in GEMM 1, so its ``block_n`` covers twice as many weight
    rows as it says. All tiles fit Hopper shared memory and compile without register spills
    for sm_90 (Triton 3.9, ptxas -v); the H200's tuned tiles come from ``tune_fused_moe.py``."""
    del H, I  # the tables fit both target shapes; kept in the signature for per-shape tuning
    fp8 = dtype == FP8_DTYPE
    rows = M * top_k / max(E, 1)
    if rows <= 16:
        # Narrow column tiles: decode streams weights, and more, smaller CTAs (about 512 KB of
        # weights each at the V4 shape) balance the SMs better than a few large ones.
        g1 = GemmTile(32, 128, 1, 4, 5 if fp8 else 4)
        g2 = GemmTile(64, 128, 1, 4, 5 if fp8 else 4)
        return FusedMoeConfig(16, g1, g2)
    if rows <= 48:
        g1 = GemmTile(64, 128, 4, 4, 4 if fp8 else 3)
        g2 = GemmTile(128, 128, 4, 4, 4 if fp8 else 3)
        return FusedMoeConfig(32, g1, g2)
    if fp8:
        # FP8 scales each K block's product before adding it, which keeps a second accumulator
        # live: 64-row tiles on 8 warps stay clear of register spills (checked with ptxas).
        return FusedMoeConfig(64, GemmTile(64, 128, 8, 8, 4), GemmTile(128, 128, 8, 8, 4))
    if rows <= 96:
        return FusedMoeConfig(64, GemmTile(64, 64, 8, 4, 4), GemmTile(128, 64, 8, 4, 4))
    return FusedMoeConfig(128, GemmTile(64, 64, 16, 8, 4), GemmTile(128, 64, 16, 8, 4))
