"""The grouped order in which the tiled GEMMs walk their output tiles: ``GROUP_M`` row tiles take
each column tile together before the next, so the programs running at once share the same weight
columns (and, in a MoE, often the same expert) in L2, and a wave fetches each weight tile from HBM
about once. The FP8 dense GEMM (``gemm/fp8_block_gemm.py``), the two-launch MoE GEMMs
(``moe/fused_moe.py`` and the MXFP4 ones built on it) and the Hopper TMA MoE GEMMs
(``moe/grouped_gemm_tma.py``, per tile of their persistent loop) all take this order."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """Tile number ``tile`` of ``num_m_blocks x num_n_blocks`` -> ``(row tile, column tile)``."""
    per_group = GROUP_M * num_n_blocks
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_rows
    pid_n = (tile % per_group) // group_rows
    return pid_m, pid_n
