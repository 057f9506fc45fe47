"""Per-request caches of DeepSeek V4 for incremental decoding.

Per layer: the sliding-window ring of raw (normed, rope'd) KV rows; for compressed layers the
compressor's state and entries; for ratio-4 layers also the indexer compressor's state and keys.
A request's cache also counts its tokens, so a forward can check that the positions it is given
continue the cache (the compressors' blocks are aligned to absolute positions).

This is a plain per-request store (one tensor set per request) that the reference attention reads
directly; a paged pool shared by many requests is a separate concern of the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.compressor_state import CompressorState
from sglang.srt.mem_cache.request_cache import RequestCache
from sglang.srt.mem_cache.window_ring import WindowRing


@dataclass
class DeepseekV4LayerCache:
    window: WindowRing
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


class DeepseekV4RequestCache(RequestCache[DeepseekV4LayerCache]):
    """One request's layer caches and token count."""


def new_request_cache(
    *,
    attn_types: tuple[str, ...],
    compress_ratios: tuple[int, ...],
    sliding_window: int,
    head_dim: int,
    index_head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> DeepseekV4RequestCache:
    """An empty cache for a model with these per-layer attention kinds and ratios."""
    layers = []
    for kind, ratio in zip(attn_types, compress_ratios):
        ring = WindowRing(sliding_window - 1, head_dim, dtype=dtype, device=device)
        comp = idx = None
        if kind != "sliding":
            overlap = kind == "csa"
            comp = CompressorState(
                ratio=ratio, dim=head_dim, overlap=overlap, entry_dtype=dtype, device=device
            )
            if kind == "csa":
                idx = CompressorState(
                    ratio=ratio, dim=index_head_dim, overlap=True, entry_dtype=dtype, device=device
                )
        layers.append(DeepseekV4LayerCache(ring, comp, idx))
    return DeepseekV4RequestCache(layers)
