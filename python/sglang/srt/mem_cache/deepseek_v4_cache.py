"""Per-request caches of DeepSeek V4 for incremental decoding.

Per layer: the sliding-window ring of raw (normed, rope'd) KV rows; for compressed layers the
compressor's state and entries; for ratio-4 layers also the indexer compressor's state and keys.
A request's cache also counts its tokens, so a forward can check that the positions it is given
continue the cache (the compressors' blocks are aligned to absolute positions).

A cache either owns its tensors (:func:`new_request_cache`, the eager reference) or views one slot
of a ``DeepseekV4SlotPool`` and its blocks (its ``request_cache``), which the static (CUDA-graph)
decode also reads and writes; the eager attention treats both alike. Both are built from one
:class:`DeepseekV4CacheShape`, the model's cache geometry.
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


@dataclass(frozen=True)
class CompressorShape:
    """One compressor of a layer: its ratio, the values an entry holds, whether its windows
    overlap, and how its entries are stored (None: the model dtype)."""

    ratio: int
    dim: int
    overlap: bool
    codec: RowCodec | None


@dataclass(frozen=True)
class DeepseekV4CacheShape:
    """What every layer's cache holds, for the per-request caches and the slot pool alike: the
    per-layer attention kinds and ratios, the window, the row widths, the model dtype (the window
    rings', and the entries' without a codec) and how compressed entries / indexer keys are
    stored (``entry_codec`` / ``index_codec``; None: the model dtype)."""

    attn_types: tuple[str, ...]
    compress_ratios: tuple[int, ...]
    sliding_window: int
    head_dim: int
    index_head_dim: int
    dtype: torch.dtype
    entry_codec: RowCodec | None = None
    index_codec: RowCodec | None = None

    def layer_compressors(self) -> list[tuple[CompressorShape | None, CompressorShape | None]]:
        """Per layer, its compressor and its indexer's: sliding layers have neither; compressed
        layers have a compressor, overlapping on CSA layers, which also have an indexer."""
        layers: list[tuple[CompressorShape | None, CompressorShape | None]] = []
        for kind, ratio in zip(self.attn_types, self.compress_ratios):
            comp = idx = None
            if kind != "sliding":
                overlap = kind == "csa"
                comp = CompressorShape(ratio, self.head_dim, overlap, self.entry_codec)
                if kind == "csa":
                    idx = CompressorShape(ratio, self.index_head_dim, True, self.index_codec)
            layers.append((comp, idx))
        return layers


def new_request_cache(
    shape: DeepseekV4CacheShape, *, device: torch.device | str = "cpu"
) -> DeepseekV4RequestCache:
    """An empty cache of this shape that owns its tensors."""

    def state(comp: CompressorShape | None) -> CompressorState | None:
        if comp is None:
            return None
        return CompressorState(
            ratio=comp.ratio,
            dim=comp.dim,
            overlap=comp.overlap,
            entry_dtype=shape.dtype,
            device=device,
            encoding=comp.codec,
        )

    layers = []
    for comp, idx in shape.layer_compressors():
        ring = WindowRing(
            shape.sliding_window - 1, shape.head_dim, dtype=shape.dtype, device=device
        )
        layers.append(DeepseekV4LayerCache(ring, state(comp), state(idx)))
    return DeepseekV4RequestCache(layers)
