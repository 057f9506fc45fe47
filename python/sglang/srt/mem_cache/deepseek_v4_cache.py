"""Per-request caches of DeepSeek V4 for incremental decoding.

Per layer: the sliding-window ring of raw (normed, rope'd) KV rows; for compressed layers the
compressor's state and entries; for ratio-4 layers also the indexer compressor's state and keys.
A request's cache also counts its tokens, so a forward can check that the positions it is given
continue the cache (the compressors' blocks are aligned to absolute positions).

A cache either owns its tensors (:func:`new_request_cache`, the eager reference) or views one slot
of a ``DeepseekV4SlotPool`` and its blocks (its ``request_cache``), which the static (CUDA-graph)
decode also reads and writes; the eager attention treats both alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.compressor_state import CompressorState
from sglang.srt.mem_cache.request_cache import RequestCache
from sglang.srt.mem_cache.row_codec import RowCodec
from sglang.srt.mem_cache.window_ring import WindowRing


@dataclass
class DeepseekV4LayerCache:
    window: WindowRing
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


class DeepseekV4RequestCache(RequestCache[DeepseekV4LayerCache]):
    """One request's layer caches and token count; ``slot`` is its pool slot (``None`` when the
    cache owns its tensors)."""

    slot: int | None = None
    # True after a static decode step: it wrote the slot's buffers on the device and advanced
    # ``num_tokens`` but no layer's host counters. Resetting every layer's counters after each
    # graph step would cost a host walk over all layers per request per step, so they are
    # brought up to date only when eager code is about to read them (:meth:`sync_layers`).
    layers_stale: bool = False

    def count_static_token(self) -> None:
        """A static decode step wrote one more token on the device: count it into
        ``num_tokens`` only (the layers' host counters catch up at :meth:`sync_layers`)."""
        self.num_tokens += 1
        self.layers_stale = True

    def resume_at(self, num_tokens: int) -> None:
        """The slot now holds the state after ``num_tokens`` tokens (a cached prefix was copied
        in): count them; the layers' host counters follow at :meth:`sync_layers`."""
        self.num_tokens = num_tokens
        self.layers_stale = True

    def sync_layers(self) -> None:
        """Set every layer's host counters from ``num_tokens`` if a static decode step left them
        behind (a no-op otherwise); call it before eager code reads or extends the layers."""
        if not self.layers_stale:
            return
        for layer in self.layers:
            layer.window.total = self.num_tokens
            for comp in (layer.compressor, layer.indexer):
                if comp is not None:
                    comp.sync_to(self.num_tokens)
        self.layers_stale = False


def new_request_cache(
    *,
    attn_types: tuple[str, ...],
    compress_ratios: tuple[int, ...],
    sliding_window: int,
    head_dim: int,
    index_head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    entry_codec: RowCodec | None = None,
    index_codec: RowCodec | None = None,
) -> DeepseekV4RequestCache:
    """An empty cache for a model with these per-layer attention kinds and ratios;
    ``entry_codec`` / ``index_codec``: how compressed entries / indexer keys are stored (None:
    the model dtype)."""
    layers = []
    for kind, ratio in zip(attn_types, compress_ratios):
        ring = WindowRing(sliding_window - 1, head_dim, dtype=dtype, device=device)
        comp = idx = None
        if kind != "sliding":
            overlap = kind == "csa"
            comp = CompressorState(
                ratio=ratio,
                dim=head_dim,
                overlap=overlap,
                entry_dtype=dtype,
                device=device,
                encoding=entry_codec,
            )
            if kind == "csa":
                idx = CompressorState(
                    ratio=ratio,
                    dim=index_head_dim,
                    overlap=True,
                    entry_dtype=dtype,
                    device=device,
                    encoding=index_codec,
                )
        layers.append(DeepseekV4LayerCache(ring, comp, idx))
    return DeepseekV4RequestCache(layers)
