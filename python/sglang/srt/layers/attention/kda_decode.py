"""KDA's single-token decode rows through the Triton kernels: the conv and the recurrent step each
one launch for all rows, reading and updating every request's states in place through a device
table of their addresses (no stack of the states, no per-request copy back).

The torch path in ``kda.py`` (stack, ``causal_conv_decode``, ``kda_recurrent``, copy back) stays
the reference and the path on the CPU and for shapes the kernels do not take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sglang.kernels.fit.decide import limits_for
from sglang.kernels.ops.kda.chunk_prefill import kda_unfit_reason
from sglang.kernels.ops.kda.conv_decode import kda_conv_decode_
from sglang.kernels.ops.kda.recurrent_step import kda_recurrent_step_, recurrent_step_reason
from sglang.kernels.ops.pointer_table import int64_on_device, pointer_table_reason
from sglang.kernels.ops.triton_dispatch import triton_can_run
from sglang.srt.layers.attention.kda_gate import L2NORM_EPS
from sglang.srt.mem_cache.kimi_k3_cache import KDAState


@dataclass(frozen=True)
class KDADecodeRows:
    """Where each decode row reads and writes: ``table [3, B]`` int64 on the device holds the
    batch row, the conv state's address and the recurrent state's address."""

    table: Tensor

    @property
    def rows(self) -> Tensor:
        return self.table[0]

    @property
    def conv_ptrs(self) -> Tensor:
        return self.table[1]

    @property
    def state_ptrs(self) -> Tensor:
        return self.table[2]


def kernel_inputs_reason(mixed: Tensor, weight: Tensor, head_dim: int) -> str | None:
    """Why the KDA decode kernels cannot take these activations and conv weight, whatever holds
    the states (per-request tensors or a slot pool); None when they can."""
    if not triton_can_run(mixed):
        return "not a CUDA tensor (and the Triton interpreter is off)"
    why = recurrent_step_reason(head_dim, head_dim) or kda_unfit_reason(head_dim, limits_for(mixed))
    if why is not None:
        return why
    if weight.dtype != torch.float32:
        return f"the conv weight is {weight.dtype}, the kernel computes in fp32"
    return None


def kernel_decode_reason(
    mixed: Tensor, weight: Tensor, states: Sequence[KDAState], heads: int, head_dim: int
) -> str | None:
    """Why these decode rows take the torch path; None when the kernels can run them."""
    why = kernel_inputs_reason(mixed, weight, head_dim)
    if why is not None:
        return why
    conv_shape = (weight.shape[1] - 1, weight.shape[0])
    convs, recs = [s.conv for s in states], [s.recurrent for s in states]
    why = pointer_table_reason(convs, conv_shape, mixed.dtype, mixed.device, "conv state")
    if why is not None:
        return why
    rec_shape = (heads, head_dim, head_dim)
    return pointer_table_reason(recs, rec_shape, torch.float32, mixed.device, "recurrent state")


def decode_rows(
    starts: Sequence[int], states: Sequence[KDAState], device: torch.device
) -> KDADecodeRows:
    """The decode rows' table, copied to ``device`` in one transfer."""
    values = [*starts]
    values += [s.conv.data_ptr() for s in states]
    values += [s.recurrent.data_ptr() for s in states]
    return KDADecodeRows(int64_on_device(values, device).view(3, len(starts)))


def kernel_decode(
    mixed: Tensor,
    g: Tensor,
    beta: Tensor,
    rows: KDADecodeRows,
    weight: Tensor,
    core: Tensor,
    head_dim: int,
) -> None:
    """Conv + SiLU, the q/k L2 norms and the recurrent step for the decode rows: ``core[rows]``
    gets their output, their states are updated in place. ``mixed [T, 3 * H * D]`` (q | k | v
    before the conv), ``g [T, H, D]``, ``beta [T, H]``, ``core [T, H, D]`` fp32."""
    b = rows.table.shape[1]
    conv_out = torch.empty(b, mixed.shape[1], dtype=mixed.dtype, device=mixed.device)
    kda_conv_decode_(mixed, weight, rows.rows, rows.conv_ptrs, conv_out)
    q, k, v = (p.unflatten(-1, (-1, head_dim)) for p in conv_out.chunk(3, dim=-1))
    kda_recurrent_step_(
        q,
        k,
        v,
        g,
        beta,
        rows.rows,
        rows.state_ptrs,
        core,
        l2norm_eps=L2NORM_EPS,
        q_scale=head_dim**-0.5,
    )
