"""Per-request caches of Kimi K3 for incremental decoding.

Per layer, one of:
- KDA (linear attention): a fixed-size state, independent of the sequence length: the conv state
  (the last ``W - 1`` pre-conv q/k/v rows, ``[W - 1, 3 * H_local * D]``, model dtype) and the
  recurrent state (``[H_local, V, K]``, V-major, fp32 by default);
- MLA: the latent KV rows, ``[n, kv_lora_rank + qk_rope_head_dim]`` (the normed ``c_kv`` then the
  shared, unrotated ``k_pe``), growing by one row a token, in the model dtype or as FP8 rows
  (``--kv-cache-dtype``: ``layers/attention/mla_kv_layout.py``).
The request also counts its tokens, so a forward can check that positions continue the cache.

A plain per-request store that the reference layers read directly, or every state in one slot of
a :class:`~sglang.srt.mem_cache.kimi_k3_slot_pool.KimiK3SlotPool` (``slot``): the KDA states rows
of its pooled tensors, the MLA latents rows paged in the blocks the slots share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from sglang.srt.mem_cache.growable_rows import GrowableRows
from sglang.srt.mem_cache.paged_rows import PagedRows
from sglang.srt.mem_cache.request_cache import RequestCache
from sglang.srt.mem_cache.row_codec import PlainRows, RowCodec

LayerKind = Literal["kda", "mla"]


@dataclass
class KDAState:
    conv: torch.Tensor  # [W - 1, 3 * H_local * D]
    recurrent: torch.Tensor  # [H_local, V, K]


@dataclass
class MLALatentCache:
    """One MLA layer's latent rows ``[n, kv_lora_rank + qk_rope_head_dim]`` as stored: in the
    model dtype (``encoding`` None, or plain), or FP8 rows (``--kv-cache-dtype fp8_e4m3``)."""

    rows: GrowableRows
    encoding: RowCodec | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def append(self, latents: torch.Tensor) -> None:
        """Append latent rows ``[m, L + rope]`` (values), encoded as this cache stores them."""
        if self.encoding is None:
            self.rows.append(latents)
        elif isinstance(self.rows, PagedRows):
            self.rows.append(latents, self.encoding)
        else:
            self.rows.append(self.encoding.encode(latents))

    def values(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Every latent row, decoded (``dtype``: default the stored dtype, or for FP8 rows the
        model dtype; FP8 rows decode exactly into fp32 and bf16)."""
        stored = self.rows.rows()
        if self.encoding is None:
            return stored if dtype is None else stored.to(dtype)
        return self.encoding.decode(stored, dtype)


LayerCache = KDAState | MLALatentCache


@dataclass(frozen=True)
class KimiK3CacheShape:
    """What one request's cache holds (a cache of its own, or a slot of the pool): the layer kinds
    and this rank's KDA and MLA widths."""

    layer_kinds: tuple[LayerKind, ...]
    kda_heads: int  # this rank's
    kda_head_dim: int
    conv_size: int
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim


class KimiK3RequestCache(RequestCache[LayerCache]):
    """One request's layer states and token count; ``slot`` is its slot of a
    :class:`~sglang.srt.mem_cache.kimi_k3_slot_pool.KimiK3SlotPool` (``None`` when the cache owns
    its tensors)."""

    slot: int | None = None

    def resume_at(self, num_tokens: int) -> None:
        """The slot now holds the state after ``num_tokens`` tokens (a cached prefix was copied
        in): count them into the length and every MLA layer's paged row count."""
        self.num_tokens = num_tokens
        for layer in self.layers:
            if isinstance(layer, MLALatentCache):
                assert isinstance(layer.rows, PagedRows)
                layer.rows.n = num_tokens

    def count_static_token(self) -> None:
        """A static decode step wrote one more token on the device: count it into the host
        counters (the length and every MLA layer's paged row count)."""
        self.num_tokens += 1
        for layer in self.layers:
            if isinstance(layer, MLALatentCache):
                assert isinstance(layer.rows, PagedRows)
                layer.rows.n += 1


def new_request_cache(
    shape: KimiK3CacheShape,
    *,
    dtype: torch.dtype,
    state_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    latent_encoding: RowCodec | None = None,
) -> KimiK3RequestCache:
    """An empty cache of this shape that owns its tensors. Zero states are the correct start of a
    sequence (no prefix). ``latent_encoding``: how the MLA latents are stored (None: the model
    dtype)."""
    heads, d = shape.kda_heads, shape.kda_head_dim
    layers: list[LayerCache] = []
    for kind in shape.layer_kinds:
        if kind == "kda":
            conv = torch.zeros(shape.conv_size - 1, 3 * heads * d, dtype=dtype, device=device)
            rec = torch.zeros(heads, d, d, dtype=state_dtype, device=device)
            layers.append(KDAState(conv, rec))
        elif kind == "mla":
            enc = latent_encoding or PlainRows(shape.latent_dim, dtype)
            rows = GrowableRows(enc.width, dtype=enc.store_dtype, device=device)
            layers.append(MLALatentCache(rows, latent_encoding))
        else:
            raise ValueError(f"unknown layer kind {kind!r}; expected 'kda' or 'mla'")
    return KimiK3RequestCache(layers)
