"""Tile configurations of the block-FP8 dense GEMM (``fp8_block_gemm.py``): a small table by
rows ``M``, split-K sized to fill the GPU, and the shared-memory estimate every launch is checked
against. A leaf (no kernels), so the layers and the benchmark read it without compiling.

Decode sizes (M <= 64) stream the weights: a tile is short in M and narrow in N, K is deep in the
pipeline, and when the output tiles alone cannot fill the SMs (``wq_a``: 16 tiles of 64 columns)
K is split over several CTAs whose fp32 partial sums a second launch adds up in a fixed order
(deterministic, so CUDA-graph replays repeat bit for bit). Prefill sizes are compute bound:
128 x 128 tiles on 8 warps (FP8 scales each K block's product before adding it, which keeps a
second accumulator live; 4 warps would spill).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sglang.kernels.fit.limits import H200

FP8_SCALE_BLOCK = 128  # weight scales cover 128 x 128, activation scales 128 values of a row
# Hopper's shared memory a block may opt into (227 KB); Triton needs it for the stages.
SM90_SHARED_LIMIT = H200.shared_optin_bytes
# Split-K never cuts a split below this many 128-wide K blocks (a split must amortise its tile).
MIN_K_BLOCKS_PER_SPLIT = 2
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class Fp8GemmConfig:
    """One launch's tiles. ``block_k`` divides 128 so a K step reads one scale per row and
    column; ``swap_ab`` computes the transposed tile (weights on the MMA's M side, which suits
    a decode row count below the MMA's 64-row minimum); ``split_k`` splits the K loop over that
    many CTAs (fp32 partials, summed by a second launch)."""

    block_m: int
    block_n: int
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    swap_ab: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if FP8_SCALE_BLOCK % self.block_k:
            raise ValueError(f"block_k {self.block_k} must divide {FP8_SCALE_BLOCK}")
        if self.split_k < 1 or self.num_stages < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"bad split_k / num_stages / num_warps in {self}")


# (largest M, tile), first match wins; beyond the last entry the last tile. Every entry compiles
# for sm_90 within SM90_SHARED_LIMIT without register spills (test_fp8_dense_gemm.py checks it
# with Triton's compiler and ptxas on the CPU).
# Up to 32 rows the tile is computed transposed (``swap_ab``): 64 weight rows fill the Hopper
# MMA's 64-row side and the few token rows its narrow side, where the plain orientation would fall
# back to the older mma.sync instructions (ptxas: no wgmma for a 16-row tile).
CONFIG_TABLE: tuple[tuple[int, Fp8GemmConfig], ...] = (
    (16, Fp8GemmConfig(16, 64, num_warps=4, num_stages=5, swap_ab=True)),
    (32, Fp8GemmConfig(32, 64, num_warps=4, num_stages=5, swap_ab=True)),
    (64, Fp8GemmConfig(64, 64, num_warps=4, num_stages=4)),
    (128, Fp8GemmConfig(64, 128, num_warps=4, num_stages=4)),
    (1 << 62, Fp8GemmConfig(128, 128, num_warps=8, num_stages=4)),
)


def shared_bytes(cfg: Fp8GemmConfig) -> int:
    """Shared memory a launch of ``cfg`` needs: the pipelined FP8 tiles of A and W, their scale
    vectors, and the epilogue's layout conversion of the fp32 tile (reusing the same buffer, so
    only the larger counts). An upper estimate of what Triton allocates on sm_90."""
    stage = cfg.block_k * (cfg.block_m + cfg.block_n) + 4 * (cfg.block_m + cfg.block_n)
    pipeline = cfg.num_stages * stage
    epilogue = 4 * cfg.block_m * cfg.block_n
    return max(pipeline, epilogue) + 1024  # barriers and alignment


def fit_to_shared(cfg: Fp8GemmConfig, limit: int) -> Fp8GemmConfig:
    """``cfg`` with as few pipeline stages dropped as it takes to fit ``limit`` bytes; refuses
    (ValueError) when even one stage does not fit, so a launch never runs out of resources."""
    while shared_bytes(cfg) > limit and cfg.num_stages > 1:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    if shared_bytes(cfg) > limit:
        raise ValueError(f"{cfg} needs {shared_bytes(cfg)} bytes of shared memory, over {limit}")
    return cfg


def split_k_for(m: int, n: int, k: int, groups: int, cfg: Fp8GemmConfig, num_sms: int) -> int:
    """How many K splits fill ``num_sms`` SMs once: 1 when the output tiles already do (or the
    rows are many: prefill is compute bound and partial sums would cost more than they give),
    never a split under :data:`MIN_K_BLOCKS_PER_SPLIT` K blocks, at most :data:`MAX_SPLIT_K`."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n) * groups
    k_blocks = -(-k // cfg.block_k)
    if m > 256 or tiles >= num_sms:
        return 1
    want = max(1, min(-(-num_sms // tiles), k_blocks // MIN_K_BLOCKS_PER_SPLIT, MAX_SPLIT_K))
    per_split = -(-k_blocks // want)
    return -(-k_blocks // per_split)  # the splits that get K blocks (the last may get fewer)


def choose_config(
    m: int,
    n: int,
    k: int,
    *,
    groups: int = 1,
    num_sms: int = 132,
    shared_limit: int = SM90_SHARED_LIMIT,
    quant_out: bool = False,
) -> Fp8GemmConfig:
    """The tile for ``[m, k] x [groups * n, k]^T`` on a GPU with ``num_sms`` SMs and
    ``shared_limit`` bytes of shared memory a block. ``quant_out`` (the epilogue writes FP8 and
    one scale per 128 columns) needs 128-column tiles."""
    cfg = next(c for top, c in CONFIG_TABLE if m <= top)
    if quant_out and cfg.block_n != FP8_SCALE_BLOCK:
        cfg = replace(cfg, block_n=FP8_SCALE_BLOCK)
    cfg = replace(cfg, split_k=split_k_for(m, n, k, groups, cfg, num_sms))
    return fit_to_shared(cfg, shared_limit)
