"""KDA's decode step for the static decode (Kimi K3's slot pool): one token for each of ``bs`` rows,
the states addressed by a device tensor of slots into pooled ``conv [S, W - 1, C]`` and
``recurrent [S, H, D, D]`` tensors, with fixed shapes and no host sync (a CUDA graph captures it).

The same maths as the eager decode step (:meth:`KimiDeltaAttention.forward` on single-token
segments): where the Triton kernels can run, the same kernels, their pointer table computed on the
device as ``base + slot * slot stride`` (the pool never moves, so a graph may bake the base in);
elsewhere the same torch step on the gathered rows, written back with one ``index_copy_`` each.
Padding rows all name the scratch slot: they race on it, and on nothing else.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sglang.kernels.ops.pointer_table import POINTER_ALIGN_BYTES
from sglang.srt.layers.attention.kda import KimiDeltaAttention
from sglang.srt.layers.attention.kda_conv import causal_conv_decode
from sglang.srt.layers.attention.kda_decode import (
    KDADecodeRows,
    kernel_decode,
    kernel_inputs_reason,
)
from sglang.srt.layers.attention.kda_recurrent import kda_recurrent


def slot_addresses(pooled: Tensor, slots: Tensor) -> Tensor:
    """The address of row ``slots[i]`` of ``pooled`` for each ``i`` (int64, on the device)."""
    return pooled.data_ptr() + slots * (pooled.stride(0) * pooled.element_size())


def static_kernel_reason(
    mixed: Tensor, weight: Tensor, conv: Tensor, recurrent: Tensor, head_dim: int
) -> str | None:
    """Why the pooled states take the torch step; None when the kernels can run on them."""
    why = kernel_inputs_reason(mixed, weight, head_dim)
    if why is not None:
        return why
    if conv.dtype != mixed.dtype or recurrent.dtype != torch.float32:
        return f"pooled states are {conv.dtype} / {recurrent.dtype}, want {mixed.dtype} / fp32"
    for t in (conv, recurrent):
        if not t.is_contiguous() or t.device != mixed.device:
            return "pooled states must be contiguous and on the activations' device"
        if t.data_ptr() % POINTER_ALIGN_BYTES or (t.stride(0) * t.element_size()) % 16:
            return f"pooled state rows are not {POINTER_ALIGN_BYTES}-byte aligned"
    return None


def kda_static_decode(
    attn: KimiDeltaAttention, x: Tensor, slots: Tensor, conv: Tensor, recurrent: Tensor
) -> Tensor:
    """``x [bs, hidden]`` (one token a row) -> ``[bs, hidden]``; steps the states of ``slots
    [bs]`` (int64, device) in ``conv`` / ``recurrent`` in place."""
    bs = x.shape[0]
    h, d = attn.local_heads, attn.config.head_dim
    mixed, g, beta = attn.project(x)
    weight = attn.conv_weight()
    if static_kernel_reason(mixed, weight, conv, recurrent, d) is not None:
        return _torch_step(attn, x, (mixed, g, beta), weight, slots, conv, recurrent)
    core = torch.zeros(bs, h, d, dtype=torch.float32, device=x.device)
    rows = torch.arange(bs, dtype=torch.long, device=x.device)
    table = torch.stack([rows, slot_addresses(conv, slots), slot_addresses(recurrent, slots)])
    kernel_decode(mixed, g, beta, KDADecodeRows(table), weight, core, d)
    return attn.finish(x, core)


def kda_static_decode_torch(
    attn: KimiDeltaAttention, x: Tensor, slots: Tensor, conv: Tensor, recurrent: Tensor
) -> Tensor:
    """:func:`kda_static_decode` in torch ops on the gathered rows (the CPU path and the kernels'
    reference)."""
    return _torch_step(attn, x, attn.project(x), attn.conv_weight(), slots, conv, recurrent)


def _torch_step(
    attn: KimiDeltaAttention,
    x: Tensor,
    inputs: tuple[Tensor, Tensor, Tensor],
    weight: Tensor,
    slots: Tensor,
    conv: Tensor,
    recurrent: Tensor,
) -> Tensor:
    mixed, g, beta = inputs
    conv_out, conv_new = causal_conv_decode(mixed, weight, conv[slots])
    q, k, v = attn.split_qkv(conv_out)
    o, rec_new = kda_recurrent(
        q.unsqueeze(1),
        k.unsqueeze(1),
        v.unsqueeze(1),
        g.unsqueeze(1),
        beta.unsqueeze(1),
        recurrent[slots],
    )
    conv.index_copy_(0, slots, conv_new)
    recurrent.index_copy_(0, slots, rec_new.to(recurrent.dtype))
    return attn.finish(x, o[:, 0])
