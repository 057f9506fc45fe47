"""Tile configurations of the MXFP4 W4A16 fused MoE (``fused_moe_mxfp4.py``): the default rule by
rows per expert, the per-device tables ``scripts/tune_moe_mxfp4.py`` writes, and the shared-memory
check every config passes before it runs.

Tables use the mechanism of ``tuned_configs.py``: one JSON file in ``configs/`` per (expert shape,
device), named with the dtype key ``mxfp4``, listing M buckets; a call of M tokens takes the bucket
with the largest ``m <= M`` (the smallest bucket below that). A bucket whose config does not fit is
skipped with one log line, and the default rule decides.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sglang.kernels.ops.moe.mxfp4_operand import MXFP4_BLOCK_K
from sglang.kernels.ops.moe.tuned_configs import (
    CONFIG_DIR,
    _device_name,
    pick_bucket,
    table_buckets,
    table_name,
)

logger = logging.getLogger(__name__)

DTYPE_KEY = "mxfp4"
SMEM_BYTES = 227 * 1024  # what a CTA may take on Hopper
SMEM_RESERVE = 8 * 1024  # barriers, the compiler's own scratch
MAX_ACC_REGS = 128  # fp32 accumulator registers a thread may hold (both accumulators of GEMM 1)


@dataclass(frozen=True)
class Mxfp4GemmTile:
    """One GEMM's tile: ``block_n`` weight rows (output columns; GEMM 1 reads that many gate and
    as many up rows), K in steps of 128, ``group_m`` row tiles visited per column tile."""

    block_n: int
    group_m: int
    num_warps: int
    num_stages: int


DOT_ORDER = "dot_order"
SPLIT = "split"
MXFP4_KERNELS = (DOT_ORDER, SPLIT)


@dataclass(frozen=True)
class Mxfp4MoeConfig:
    """``block_m``: routed rows (tokens) a tile, shared by both GEMMs (the alignment of the sorted
    rows). ``x_in_dot_order``: put the hidden states in the GEMM's K order once, ahead of GEMM 1
    (one small pass), instead of reordering every activation tile in the GEMM. ``kernel``: which
    GEMM kernels run: ``"dot_order"`` (``fused_moe_mxfp4.py``: one 128-wide operand a K tile,
    warpgroup MMAs; prefill) or ``"split"`` (``mxfp4_split_gemm.py``: low- and high-nibble
    operands from registers, every load pipelined, gate and up rows in one tile; decode)."""

    block_m: int
    gemm1: Mxfp4GemmTile
    gemm2: Mxfp4GemmTile
    x_in_dot_order: bool = False
    kernel: str = DOT_ORDER


def default_mxfp4_config(m: int, e: int, top_k: int) -> Mxfp4MoeConfig:
    """Tiles for ``m`` tokens, ``e`` experts and ``top_k``, by the average rows an expert gets:
    few (decode) -> the GEMMs stream 4-bit weights, 16-row tiles (the MMA's smallest) with deep
    pipelines; many (prefill) -> 64- and 128-row tiles. Compiled for sm_90 on the CPU by the
    tests (no spills, shared memory fits); the H200 tables refine them."""
    rows = m * top_k / max(e, 1)
    # Batch-1-like decode (a few experts touched): the split kernel, 64 weight rows a tile
    # (GEMM 1: 32 gate and 32 up) and 6 stages: at batch 1 of DeepSeek V4 384 tiles a GEMM,
    # all resident at 3 a SM. Measured on the H200 (scripts/mxfp4_decode_probe.py): 69 us
    # against the dot-order kernel's 80 at batch 1, but 253 against 216 at batch 4, so only
    # while the routed rows are few.
    if m * top_k <= max(e // 16, top_k):
        return Mxfp4MoeConfig(
            16, Mxfp4GemmTile(32, 1, 4, 6), Mxfp4GemmTile(64, 1, 4, 6), kernel=SPLIT
        )
    # GEMM 2 takes 128 weight rows a tile (fewer instructions a weight value than 64, checked in
    # SASS); GEMM 1 reads 64 gate and 64 up rows, and keeps enough tiles for 132 SMs at batch 1.
    if rows <= 16:
        return Mxfp4MoeConfig(16, Mxfp4GemmTile(64, 1, 4, 4), Mxfp4GemmTile(128, 1, 4, 4))
    if rows <= 48:
        return Mxfp4MoeConfig(32, Mxfp4GemmTile(64, 4, 4, 4), Mxfp4GemmTile(128, 4, 4, 4))
    if rows <= 96:
        tile = Mxfp4GemmTile(64, 8, 4, 3)
        return Mxfp4MoeConfig(64, tile, tile, x_in_dot_order=True)
    # GEMM 1 keeps two accumulators: 64 columns of each on 8 warps stay clear of spills (128
    # spill with Triton 3.6, ptxas -v)
    return Mxfp4MoeConfig(
        128, Mxfp4GemmTile(64, 16, 8, 3), Mxfp4GemmTile(128, 16, 8, 3), x_in_dot_order=True
    )


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


# The split kernel's layout conversions of its register operands and output (measured with
# Triton 3.9 for sm_90: 12032 bytes past the stages at every decode tile).
SPLIT_SCRATCH_BYTES = 12 * 1024


def gemm_smem_bytes(
    tile: Mxfp4GemmTile, block_m: int, gate_up: bool, a_in_dot_order: bool, split: bool = False
) -> int:
    """Shared memory of one GEMM: each pipeline stage holds the packed weight rows (GEMM 1 reads
    ``block_n`` gate and as many up rows) with their scale words and the activation tile; an
    activation tile reordered in the GEMM is staged once more for the MMA; the epilogue re-lays
    the output tile out through shared memory (the split kernel: its conversion scratch)."""
    rows = (2 if gate_up else 1) * tile.block_n
    weights = rows * (MXFP4_BLOCK_K // 2 + 4)
    acts = block_m * MXFP4_BLOCK_K * 2
    staged = 0 if a_in_dot_order else acts
    epilogue = rows * block_m * 4
    extra = max(staged, epilogue, SPLIT_SCRATCH_BYTES if split else 0)
    return tile.num_stages * (weights + acts) + extra


def mxfp4_config_fits(cfg: Mxfp4MoeConfig, hidden: int, inter: int) -> str | None:
    """Why ``cfg`` cannot run at this shape (None when it can)."""
    if cfg.kernel not in MXFP4_KERNELS:
        return f"kernel must be one of {MXFP4_KERNELS}, got {cfg.kernel!r}"
    if not _pow2(cfg.block_m) or cfg.block_m < 16:
        return f"block_m must be a power of two >= 16 (the MMA's smallest N), got {cfg.block_m}"
    split = cfg.kernel == SPLIT
    for name, tile, n_cols, gate_up, in_order in (
        ("gemm1", cfg.gemm1, inter, True, cfg.x_in_dot_order),
        ("gemm2", cfg.gemm2, hidden, False, True),
    ):
        # split GEMM 1 tiles hold 2 * block_n rows, in runs of 8 gate and 8 up rows
        low, high = (8, 128) if split and gate_up else (16, 256)
        if not _pow2(tile.block_n) or not low <= tile.block_n <= high:
            return f"{name}: block_n must be a power of two in [{low}, {high}], got {tile.block_n}"
        if n_cols % tile.block_n:
            return f"{name}: block_n {tile.block_n} does not divide its {n_cols} output columns"
        warps = (1, 2, 4, 8) if split else (4, 8)
        if tile.num_warps not in warps or tile.num_stages < 1 or tile.group_m < 1:
            return f"{name}: needs {warps} warps, >= 1 stage and group_m >= 1, got {tile}"
        acc_regs = (2 if gate_up else 1) * tile.block_n * cfg.block_m // (32 * tile.num_warps)
        if acc_regs > MAX_ACC_REGS:
            return f"{name}: accumulators need {acc_regs} registers a thread (> {MAX_ACC_REGS})"
        smem = gemm_smem_bytes(tile, cfg.block_m, gate_up, in_order, split)
        if smem > SMEM_BYTES - SMEM_RESERVE:
            return f"{name}: {smem} bytes of shared memory (> {SMEM_BYTES - SMEM_RESERVE})"
    return None


def config_to_dict(cfg: Mxfp4MoeConfig) -> dict[str, Any]:
    return asdict(cfg)


def config_from_dict(d: dict[str, Any]) -> Mxfp4MoeConfig:
    return Mxfp4MoeConfig(
        int(d["block_m"]),
        Mxfp4GemmTile(**d["gemm1"]),
        Mxfp4GemmTile(**d["gemm2"]),
        x_in_dot_order=bool(d.get("x_in_dot_order", False)),
        kernel=str(d.get("kernel", DOT_ORDER)),
    )


@functools.cache
def load_mxfp4_table(name: str) -> tuple[tuple[int, Mxfp4MoeConfig], ...] | None:
    """``(m, config)`` buckets of table ``name`` sorted by m, or None when there is no such file."""
    raw = table_buckets(CONFIG_DIR / name)
    if raw is None:
        return None
    return tuple((int(b["m"]), config_from_dict(b["config"])) for b in raw)


@functools.cache
def _log_choice(what: str) -> None:
    logger.info("MXFP4 fused MoE: %s", what)


def select_mxfp4_config(
    m: int, e: int, h: int, i: int, *, top_k: int, device: torch.device
) -> Mxfp4MoeConfig:
    """The table's bucket for ``m`` tokens on this device, else the default rule."""
    dev_name = _device_name(device)
    if dev_name is not None:
        name = table_name(e, h, i, top_k, DTYPE_KEY, dev_name)
        buckets = load_mxfp4_table(name)
        if buckets:
            m_bucket, cfg = pick_bucket(buckets, m)
            why = mxfp4_config_fits(cfg, h, i)
            if why is None:
                _log_choice(f"{name}, M bucket {m_bucket}: {cfg}")
                return cfg
            _log_choice(f"{name}, M bucket {m_bucket} skipped ({why}); default rule")
    return default_mxfp4_config(m, e, top_k)
