"""Tile configurations of the two-launch fused MoE (``fused_moe.py``): the default rule by rows
per expert. A leaf, so the tuned-table lookup (``tuned_configs.py``) and the kernels both read
it."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sglang.kernels.fit.footprint import Footprint, fit_reason, pipelined_dot_shared
from sglang.kernels.fit.limits import DeviceLimits
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


def gemm_footprint(
    block_m: int,
    tile: GemmTile,
    elem_bytes: int,
    *,
    gate_up: bool,
    capability: tuple[int, int] = (9, 0),
) -> Footprint:
    """One program of GEMM 1 (``gate_up``: gate and up weight tiles side by side, twice
    ``block_n`` columns) or GEMM 2 at this tile, operands of ``elem_bytes`` (FP8: activations
    quantised to 1 byte too)."""
    shared = pipelined_dot_shared(
        block_m=block_m,
        block_k=tile.block_k,
        a_bytes=elem_bytes,
        b_cols=(2 if gate_up else 1) * tile.block_n,
        b_bytes=elem_bytes,
        num_stages=tile.num_stages,
        num_warps=tile.num_warps,
        capability=capability,
    )
    return Footprint(shared, tile.num_warps)


def two_launch_unfit_reason(
    cfg: FusedMoeConfig, elem_bytes: int, limits: DeviceLimits | None
) -> str | None:
    """Why ``cfg`` does not fit ``limits`` with operands of ``elem_bytes`` (None: it fits)."""
    cap = limits.capability if limits is not None else (9, 0)
    for name, tile, gate_up in (("GEMM 1", cfg.gemm1, True), ("GEMM 2", cfg.gemm2, False)):
        fp = gemm_footprint(cfg.block_m, tile, elem_bytes, gate_up=gate_up, capability=cap)
        why = fit_reason(
            f"fused MoE {name} tile {cfg.block_m}x{tile.block_n}x{tile.block_k} "
            f"({tile.num_stages} stages, {elem_bytes}-byte operands)",
            fp,
            limits,
        )
        if why is not None:
            return why
    return None


def _smaller_tiles(tile: GemmTile) -> list[GemmTile]:
    """``tile`` with fewer pipeline stages (down to 2), then with its K and N blocks halved in
    turn (each again from its own stage count down): the order of the fallbacks."""
    out: list[GemmTile] = []
    shapes = [tile]
    bk, bn = tile.block_k, tile.block_n
    while bk > 32:
        bk //= 2
        shapes.append(replace(tile, block_k=bk))
    while bn > 16:
        bn //= 2
        shapes.append(replace(tile, block_k=bk, block_n=bn))
    for shape in shapes:
        out += [replace(shape, num_stages=s) for s in range(shape.num_stages, 1, -1)]
        if shape.num_stages < 2:
            out.append(shape)
    return out


def fit_two_launch_config(
    cfg: FusedMoeConfig, elem_bytes: int, limits: DeviceLimits | None
) -> FusedMoeConfig | None:
    """``cfg`` when it fits ``limits``, else the first smaller configuration that does (fewer
    stages, then smaller K, N and M blocks), or None when none does."""
    if two_launch_unfit_reason(cfg, elem_bytes, limits) is None:
        return cfg
    block_m = cfg.block_m
    while block_m >= 16:
        tiles = []
        for gemm, gate_up in ((cfg.gemm1, True), (cfg.gemm2, False)):
            fitting = next(
                (
                    t
                    for t in _smaller_tiles(gemm)
                    if fit_reason(
                        "",
                        gemm_footprint(
                            block_m,
                            t,
                            elem_bytes,
                            gate_up=gate_up,
                            capability=limits.capability if limits else (9, 0),
                        ),
                        limits,
                    )
                    is None
                ),
                None,
            )
            tiles.append(fitting)
        if tiles[0] is not None and tiles[1] is not None:
            return FusedMoeConfig(block_m, tiles[0], tiles[1])
        block_m //= 2
    return None
