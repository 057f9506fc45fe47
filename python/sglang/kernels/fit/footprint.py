"""What one launch of a kernel configuration needs from an SM, and whether a device has it.

The numbers are the compiler's, written as formulas of the configuration so a decision needs no
compilation: Triton keeps each pipelined ``tl.dot`` operand tile in shared memory, once per
stage, and the sm_90 compiler (Triton 3.6 on the H200, 3.9 here) uses

* Hopper's warp-group MMA (``wgmma``) when a block has at least 64 rows and whole warp groups:
  ``num_stages`` buffers of each operand tile;
* the Ampere MMA otherwise (fewer rows, pre-Hopper GPUs): ``num_stages - 1`` buffers (one when
  the loop is not pipelined);
* TMA tensor-descriptor loads: ``num_stages`` buffers and an 8-byte barrier per stage.

``test/registered/kernels/test_kernel_fit.py`` checks these formulas against the sm_90 compiler
(``sglang.test.sm90_compile``) for every kernel family that has one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.kernels.fit.limits import DeviceLimits


@dataclass(frozen=True)
class Footprint:
    """One thread block of a launch: ``shared_bytes`` of shared memory, ``num_warps`` warps,
    ``registers`` a thread when known (None: the compiler caps it to fit the block), and the
    blocks a persistent launch keeps resident on one SM."""

    shared_bytes: int
    num_warps: int
    registers: int | None = None
    ctas_per_sm: int = 1  # blocks the launch needs resident on one SM at once

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


def element_bytes(dtype: torch.dtype) -> int:
    """Bytes of one element as a kernel loads it (FP8: 1, bf16/fp16: 2, fp32: 4)."""
    return torch.empty((), dtype=dtype).element_size()


def uses_wgmma(block_m: int, num_warps: int, capability: tuple[int, int] = (9, 0)) -> bool:
    """Whether Triton lowers a ``tl.dot`` of ``block_m`` rows on ``num_warps`` warps to Hopper's
    warp-group MMA (which pipelines one more stage in shared memory)."""
    return capability >= (9, 0) and block_m >= 64 and num_warps % 4 == 0


def pipelined_dot_shared(
    *,
    block_m: int,
    block_k: int,
    a_bytes: int,
    b_cols: int,
    b_bytes: int,
    num_stages: int,
    num_warps: int,
    capability: tuple[int, int] = (9, 0),
) -> int:
    """Shared bytes of a K loop that loads an ``[block_m, block_k]`` A tile and a ``[block_k,
    b_cols]`` B tile (by pointers) into one ``tl.dot`` a step."""
    stage = block_k * (block_m * a_bytes + b_cols * b_bytes)
    if uses_wgmma(block_m, num_warps, capability):
        buffers = max(1, num_stages)
    else:
        buffers = max(1, num_stages - 1)
    return buffers * stage


def tma_pipeline_shared(*, stage_bytes: int, num_stages: int) -> int:
    """Shared bytes of a K loop fed by tensor descriptors: ``num_stages`` buffers of
    ``stage_bytes`` and an mbarrier each."""
    return max(1, num_stages) * (stage_bytes + 8)


def tile_footprint(elements: int, num_warps: int, elem_bytes: int = 4) -> Footprint:
    """An elementwise or row-reduction program over a tile of ``elements`` values: at most one
    copy of the tile in shared memory (a layout conversion or a cross-warp reduction)."""
    return Footprint(elements * elem_bytes, num_warps)


def fit_reason(what: str, footprint: Footprint, limits: DeviceLimits | None) -> str | None:
    """None when a block of ``footprint`` fits ``limits`` (always, without limits: CPU or the
    interpreter), else why not, naming ``what`` and the numbers."""
    if limits is None:
        return None
    if footprint.shared_bytes > limits.shared_optin_bytes:
        return (
            f"{what} needs {footprint.shared_bytes} B of shared memory a block, "
            f"{limits.name} allows {limits.shared_optin_bytes} B"
        )
    if footprint.ctas_per_sm * footprint.shared_bytes > limits.shared_per_sm_bytes:
        return (
            f"{what} keeps {footprint.ctas_per_sm} blocks of {footprint.shared_bytes} B resident "
            f"an SM, {limits.name} has {limits.shared_per_sm_bytes} B of shared memory an SM"
        )
    if footprint.threads > limits.max_threads_per_block:
        return (
            f"{what} runs {footprint.threads} threads a block, "
            f"{limits.name} allows {limits.max_threads_per_block}"
        )
    regs = footprint.registers
    if regs is not None and regs * footprint.threads > limits.regs_per_block:
        return (
            f"{what} needs {regs} registers x {footprint.threads} threads a block, "
            f"{limits.name} has {limits.regs_per_block}"
        )
    return None
