"""KDA's multi-token segments through the chunked Triton kernels
(``kernels/ops/kda/chunk_prefill.py``).

The torch form in ``kda_chunk.py`` stays the reference, and the path on the CPU, for the unbounded
gate, and with ``SGLANG_K3_KDA_PREFILL=torch``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sglang.kernels.fit.decide import limits_for
from sglang.kernels.ops.kda.chunk_prefill import (
    chunk_prefill_reason,
    kda_chunk_prefill_,
    kda_unfit_reason,
)
from sglang.kernels.ops.kda.conv_prefill import kda_conv_prefill
from sglang.kernels.ops.triton_dispatch import triton_can_run
from sglang.srt.layers.attention.kda_conv import conv_state_after


def prefill_kernel_reason(
    q: Tensor, head_dim: int, gate_lower_bound: float | None, mode: str
) -> str | None:
    """Why a prefill segment takes the torch path; None when the kernels run it."""
    if mode == "torch":
        return "the torch form was asked for"
    if not triton_can_run(q):
        return "not a CUDA tensor (and the Triton interpreter is off)"
    return chunk_prefill_reason(head_dim, head_dim, gate_lower_bound) or kda_unfit_reason(
        head_dim, limits_for(q)
    )


def kernel_conv_prefill(x: Tensor, weight: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """``causal_conv_prefill`` through the Triton kernel: ``(silu(conv) [T, C], new state)``."""
    return kda_conv_prefill(x, weight, state), conv_state_after(x, state)


def kernel_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    recurrent: Tensor,
    out: Tensor,
    precision: str,
) -> None:
    """One segment: ``out [T, H, V]`` (fp32) gets the core output and ``recurrent [H, V, K]`` is
    stepped over the ``T`` tokens in place (through an fp32 copy when it is stored narrower or
    strided)."""
    in_place = recurrent.dtype == torch.float32 and recurrent.stride(-1) == 1
    state = recurrent if in_place else recurrent.float().contiguous()
    kda_chunk_prefill_(q, k, v, g, beta, state, out, state, precision=precision)
    if not in_place:
        recurrent.copy_(state)
