"""The preallocated, paged cache of Kimi K3: every running request owns one *slot* (a row of the
fixed-size KDA states) and the blocks of a shared pool its MLA latents need, so memory follows
live lengths and a decode step has fixed shapes and fixed addresses (a CUDA graph can capture
it). The same pool serves the eager decode (the static decode's gate closed) and the static one.

Per slot (``S = max_slots + 1`` rows; the last is the scratch slot, where a padded batch's padding
rows write, so they never touch a real request), per KDA layer:
- ``conv [S, W - 1, 3 * H_local * D]`` (model dtype): the last ``W - 1`` pre-conv q/k/v rows;
- ``recurrent [S, H_local, D, D]`` (the state dtype, fp32 by default): the delta-rule state.
Paged, per MLA layer: ``latents [num_blocks + 1, B, width]`` (``kv_lora_rank + rope`` values of the
model dtype, or FP8 rows of ``width`` bytes: ``--kv-cache-dtype``), block ``i`` of a
slot's table row holding its tokens ``i * B ..`` in every MLA layer (one
:class:`PagedBlockTable`, ``[S, ceil(capacity / B)]`` on the device). The extra block is the null
block that unused table entries (and the scratch slot, whose row never gets a block) point to.

The eager forward reaches a slot through views (:meth:`KimiK3SlotPool.request_cache`: the KDA
states are rows of the pooled tensors, the latents :class:`PagedRows`); the static decode indexes
the whole tensors with a device tensor of slots. Both write the same storage, so a request
prefilled eagerly decodes in a graph with no copy. A slot's KDA states are zeroed when it is
taken (zero is the start of a sequence); its latents need no reset (reads stop at the length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.kimi_k3_cache import (
    KDAState,
    KimiK3CacheShape,
    KimiK3RequestCache,
    LayerCache,
    MLALatentCache,
)
from sglang.srt.mem_cache.paged_rows import PagedRows
from sglang.srt.mem_cache.row_codec import PlainRows, RowCodec
from sglang.srt.mem_cache.slot_blocks import SlotBlocks, SlotPoolSize


@dataclass(frozen=True)
class KDASlots:
    """One KDA layer's states of every slot."""

    conv: torch.Tensor  # [S, W - 1, 3 * H_local * D]
    recurrent: torch.Tensor  # [S, H_local, D, D]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))


class KimiK3SlotPool(SlotBlocks):
    def __init__(
        self,
        shape: KimiK3CacheShape,
        size: SlotPoolSize,
        *,
        dtype: torch.dtype,
        state_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        latent_encoding: RowCodec | None = None,
    ) -> None:
        """A pool of ``size`` (its blocks hold the MLA latents). ``latent_encoding``: how the
        latents are stored (None: the model dtype)."""
        bad = [k for k in shape.layer_kinds if k not in ("kda", "mla")]
        if bad:
            raise ValueError(f"unknown layer kinds {bad}; expected 'kda' or 'mla'")
        dev = torch.device(device)
        self.shape = shape
        self.latent_encoding: RowCodec = latent_encoding or PlainRows(shape.latent_dim, dtype)
        if self.latent_encoding.dim != shape.latent_dim:
            raise ValueError(
                f"latent rows of {self.latent_encoding.dim} values in a pool of {shape.latent_dim}"
            )
        super().__init__(size, device=dev)
        rows, num_blocks = self.rows, self.block_pool.num_blocks
        width = 3 * shape.kda_heads * shape.kda_head_dim
        d = shape.kda_head_dim
        # Per layer: KDASlots for KDA layers, the latent store for MLA layers.
        self.kda: list[KDASlots | None] = []
        self.latents: list[torch.Tensor | None] = []
        for kind in shape.layer_kinds:
            if kind == "kda":
                conv = torch.zeros(rows, shape.conv_size - 1, width, dtype=dtype, device=dev)
                rec = torch.zeros(rows, shape.kda_heads, d, d, dtype=state_dtype, device=dev)
                self.kda.append(KDASlots(conv, rec))
                self.latents.append(None)
            else:
                enc = self.latent_encoding
                store = torch.zeros(
                    num_blocks + 1, self.block_tokens, enc.width, dtype=enc.store_dtype, device=dev
                )
                self.kda.append(None)
                self.latents.append(store)

    def nbytes(self) -> int:
        total = sum(k.nbytes() for k in self.kda if k is not None)
        total += sum(s.numel() * s.element_size() for s in self.latents if s is not None)
        return total + self.table_nbytes()

    def edge_state(self) -> list[torch.Tensor]:
        """Besides its latents (blocks), a request's state is every KDA layer's conv and
        recurrent state: not a function of any block, so it is copied at the edges a prefix may
        resume from."""
        return [t for k in self.kda if k is not None for t in (k.conv, k.recurrent)]

    def _reset(self, slot: int) -> None:
        """A slot taken anew starts a sequence: its KDA states zeroed."""
        for k in self.kda:
            if k is not None:
                k.conv[slot].zero_()
                k.recurrent[slot].zero_()

    def request_cache(self, slot: int) -> KimiK3RequestCache:
        """An empty cache over ``slot`` (the caller allocated it): views of its states and its
        latent rows, which the eager forward reads and writes in place."""
        layers: list[LayerCache] = []
        for k, store in zip(self.kda, self.latents):
            if k is not None:
                layers.append(KDAState(k.conv[slot], k.recurrent[slot]))
            else:
                assert store is not None
                held = self.blocks.blocks(slot)
                rows = PagedRows(store, self.blocks.table[slot], held)
                layers.append(MLALatentCache(rows, self.latent_encoding))
        cache = KimiK3RequestCache(layers)
        cache.slot = slot
        return cache
