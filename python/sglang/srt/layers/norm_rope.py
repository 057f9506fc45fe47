"""RMSNorm (weighted, unweighted or none) + interleaved RoPE + cast of per-head rows: the fused
Triton kernel where it can run and the shapes fit, else the torch ops it fuses (the reference,
and the CPU path). DeepSeek V4's attention runs its q, kv, indexer-q, q_norm and output rows
through here."""

from __future__ import annotations

import torch

from sglang.kernels.ops.attention.norm_rope import (
    NO_NORM,
    RowNorm,
    norm_rope_torch,
    norm_rope_unfit_reason,
)
from sglang.kernels.ops.attention.norm_rope import norm_rope as norm_rope_kernel
from sglang.kernels.ops.triton_dispatch import triton_can_run
from sglang.srt.utils.log import get_logger, log_path_once

logger = get_logger(__name__)

__all__ = ["NO_NORM", "RowNorm", "norm_rope"]


def norm_rope(
    x: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    *,
    norm: RowNorm = NO_NORM,
    inverse: bool = False,
    dtype: torch.dtype | None = None,
    reuse_input: bool = False,
) -> torch.Tensor:
    """``x [T, D]`` or ``[T, heads, D]`` -> normed (``norm``), rotated on its last
    ``2 * cos.shape[-1]`` channels (when ``cos``/``sin`` ``[T, rope / 2]`` are given; ``inverse``
    by the negative angle), cast to ``dtype`` (default x's). ``reuse_input``: the caller gives x
    up, so the kernel may write the result over it (saves a prefill-sized allocation)."""
    dtype = dtype or x.dtype
    if triton_can_run(x):
        out = x if reuse_input and dtype == x.dtype else torch.empty_like(x, dtype=dtype)
        why = norm_rope_unfit_reason(x, out, cos, sin, norm)
        log_path_once(logger, "norm + RoPE", why)
        if why is None:
            return norm_rope_kernel(x, cos, sin, out=out, norm=norm, inverse=inverse)
    return norm_rope_torch(x, cos, sin, norm=norm, inverse=inverse, dtype=dtype)
