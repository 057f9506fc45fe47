"""How DeepSeek V4's caches store their rows under ``--kv-cache-dtype`` (docs/kv_cache.md): the
sliding-window ring always in the model dtype (a fixed 128 rows a layer and request: FP8 there
would not change how many tokens fit, and it holds the most attended keys); the compressed
entries (FlashMLA's V4 layout: 448 e4m3 + 64 bf16 rope + 7 UE8M0 scales + pad = 584 bytes) and the
indexer keys (all 128 values e4m3: they only rank entries) in the model dtype or as FP8 rows.
``auto`` is FP8 when the model computes in bf16, as DeepSeek's inference recipe."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.layers.kv_cache_rows import row_codec
from sglang.srt.mem_cache.kv_cache_dtype import KVCacheChoice, resolve_kv_cache_dtype
from sglang.srt.mem_cache.row_codec import RowCodec

# What ``--kv-cache-dtype auto`` follows for DeepSeek V4 (docs/kv_cache.md).
DSV4_FP8_RECIPE = (
    "DeepSeek's V4 inference recipe (FP8 compressed KV in FlashMLA's layout, FP8 indexer keys)"
)


@dataclass(frozen=True)
class DeepseekV4KVLayout:
    """How DeepSeek V4's caches store their rows (``--kv-cache-dtype``): the sliding-window ring
    always in the model dtype; the compressed entries (``head_dim`` values, the last ``rope``
    of them positional) and the indexer keys in the model dtype or as FP8 rows."""

    window: RowCodec
    entries: RowCodec
    index_keys: RowCodec
    choice: KVCacheChoice

    @classmethod
    def build(
        cls,
        *,
        head_dim: int,
        rope_dim: int,
        index_head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str,
    ) -> DeepseekV4KVLayout:
        choice = resolve_kv_cache_dtype(kv_cache_dtype, dtype, fp8_recipe=DSV4_FP8_RECIPE)
        return cls(
            window=row_codec(head_dim, dtype, fp8=False),
            entries=row_codec(head_dim, dtype, fp8=choice.fp8, rope=rope_dim),
            # DeepSeek quantises the whole indexer key (no bf16 tail): it only ranks entries
            index_keys=row_codec(index_head_dim, dtype, fp8=choice.fp8),
            choice=choice,
        )

    def describe(self) -> str:
        return (
            f"KV cache {self.choice.name} ({self.choice.why}): window rings "
            f"{self.window.describe()} a row, compressed entries {self.entries.describe()}, "
            f"indexer keys {self.index_keys.describe()}"
        )
