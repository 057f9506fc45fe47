"""How Kimi K3's MLA latents are stored under ``--kv-cache-dtype`` (docs/kv_cache.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.layers.kv_cache_rows import row_codec
from sglang.srt.mem_cache.kv_cache_dtype import KVCacheChoice, resolve_kv_cache_dtype
from sglang.srt.mem_cache.row_codec import RowCodec


@dataclass(frozen=True)
class KimiK3KVLayout:
    """How Kimi K3's MLA latents are stored (``--kv-cache-dtype``): the model dtype, or FP8 rows
    (``c_kv`` e4m3 in groups of 64 with UE8M0 scales, ``k_pe`` bf16: 648 bytes at 512 + 64).
    ``auto`` keeps the model dtype: no published recipe caches K3's latents in FP8. The KDA
    states are fixed-size and stay as they are."""

    latents: RowCodec
    choice: KVCacheChoice

    @classmethod
    def build(
        cls, *, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype, kv_cache_dtype: str
    ) -> KimiK3KVLayout:
        choice = resolve_kv_cache_dtype(kv_cache_dtype, dtype, fp8_recipe=None)
        latents = row_codec(kv_lora_rank + rope_dim, dtype, fp8=choice.fp8, rope=rope_dim)
        return cls(latents=latents, choice=choice)

    def describe(self) -> str:
        return (
            f"KV cache {self.choice.name} ({self.choice.why}): MLA latents "
            f"{self.latents.describe()} a row"
        )
