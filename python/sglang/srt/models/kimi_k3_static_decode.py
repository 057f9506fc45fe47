"""Kimi K3's static decode: one token per pooled request with fixed shapes and no host sync (the
body of a decode CUDA graph), over the slot pool of ``mem_cache/kimi_k3_slot_pool.py``.

The layer loop is the eager forward's (:meth:`KimiK3ForCausalLM._run_layers`: embedding, AttnRes
reads, MoE or dense MLP, the last read, norm and LM head, all token-local); only the attention
differs: a KDA layer steps its pooled states by slot (``kda_static_decode.py``), an MLA layer
writes its latent at the row's position and attends over its slot's paged latents
(``mla_static_decode.py``). Padding rows decode token 0 at position 0 in the scratch slot.

Gated: the executor takes it only with ``SGLANG_K3_STATIC_DECODE`` on (:func:`static_decode_gate_
reason`), until the graphs have run on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor

from sglang.srt.environ import envs
from sglang.srt.layers.attention.kda import KimiDeltaAttention
from sglang.srt.layers.attention.kda_static_decode import kda_static_decode
from sglang.srt.layers.attention.mla_nope import MLANoPEAttention
from sglang.srt.layers.attention.mla_static_decode import mla_static_decode
from sglang.srt.mem_cache.kimi_k3_slot_pool import KimiK3SlotPool


class StaticLayer(Protocol):
    """What the static attention needs of a decoder layer."""

    layer_id: int
    self_attn: KimiDeltaAttention | MLANoPEAttention


# The attention of one layer on its normed input ``x [bs, hidden]``.
StaticAttend = Callable[[StaticLayer, Tensor], Tensor]


def static_decode_gate_reason() -> str | None:
    """Why the executor must not take Kimi K3's static decode (None: ``SGLANG_K3_STATIC_DECODE``
    is on)."""
    if envs.SGLANG_K3_STATIC_DECODE.get():
        return None
    return (
        "SGLANG_K3_STATIC_DECODE is off: Kimi K3 decodes eagerly on per-request caches, "
        "without its slot pool and CUDA graphs"
    )


def static_attend(pool: KimiK3SlotPool, positions: Tensor, slots: Tensor) -> StaticAttend:
    """The attention of every layer for one static step of rows at ``positions`` in ``slots``
    (int64 ``[bs]`` on the device)."""
    table = pool.blocks.table

    def attend(layer: StaticLayer, x: Tensor) -> Tensor:
        i = layer.layer_id
        attn = layer.self_attn
        if isinstance(attn, KimiDeltaAttention):
            kda = pool.kda[i]
            assert kda is not None, f"layer {i} is KDA, the pool holds MLA latents there"
            return kda_static_decode(attn, x, slots, kda.conv, kda.recurrent)
        store = pool.latents[i]
        assert store is not None, f"layer {i} is MLA, the pool holds KDA states there"
        return mla_static_decode(attn, x, positions, slots, store, table, pool.latent_encoding)

    return attend
