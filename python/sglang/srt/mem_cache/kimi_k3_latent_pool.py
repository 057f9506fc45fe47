"""Kimi K3's paged MLA latent cache: every MLA layer's latent rows of every request in blocks of
one shared pool, so a request holds memory for its live length only and returns it on finish.

Per MLA layer one store ``[num_blocks + 1, B, kv_lora_rank + qk_rope_head_dim]`` (the extra block
is the null block of :class:`PagedBlockTable`); one block table row per request serves every MLA
layer (its block ``i`` holds tokens ``i * B ..`` of each layer). The KDA layers' state is fixed-size
per request (conv rows and the recurrent state, independent of the length), so it stays in the
request's own tensors: paging it would only add indirection.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang.srt.mem_cache.block_pool import BlockPool
from sglang.srt.mem_cache.kimi_k3_cache import KimiK3RequestCache, LayerKind, MLALatentCache
from sglang.srt.mem_cache.paged_block_table import PagedBlockTable
from sglang.srt.mem_cache.paged_rows import PagedRows


class KimiK3PoolFullError(RuntimeError):
    """Every request row is taken; the scheduler admits at most ``max_requests``."""


class KimiK3LatentPool:
    def __init__(
        self,
        *,
        layer_kinds: Sequence[LayerKind],
        latent_dim: int,
        max_requests: int,
        capacity: int,
        num_blocks: int,
        block_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_requests < 1:
            raise ValueError(f"latent pool needs >= 1 request row, got {max_requests}")
        self.block_pool = BlockPool(num_blocks, block_tokens)
        self.blocks = PagedBlockTable(
            self.block_pool, rows=max_requests, max_tokens=capacity, device=device
        )
        self.max_requests = max_requests
        # One store per layer, None for KDA layers (fixed-size state, not paged).
        self.stores: list[torch.Tensor | None] = [
            torch.zeros(num_blocks + 1, block_tokens, latent_dim, dtype=dtype, device=device)
            if kind == "mla"
            else None
            for kind in layer_kinds
        ]
        self._free = list(range(max_requests - 1, -1, -1))  # lowest row first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.stores if s is not None)

    def alloc(self) -> int:
        if not self._free:
            raise KimiK3PoolFullError(f"all {self.max_requests} latent-cache rows are in use")
        return self._free.pop()

    def attach(self, cache: KimiK3RequestCache, row: int) -> None:
        """Point ``cache``'s (empty) MLA layers at ``row``'s blocks."""
        for i, store in enumerate(self.stores):
            if store is not None:
                paged = PagedRows(store, self.blocks.table[row], self.blocks.blocks(row))
                cache.layers[i] = MLALatentCache(paged)

    def reserve(self, row: int, tokens: int) -> None:
        """Blocks for ``tokens`` tokens before a forward writes them (all or none)."""
        self.blocks.ensure(row, tokens)

    def free(self, row: int) -> None:
        if not 0 <= row < self.max_requests or row in self._free:
            raise ValueError(f"row {row} is not an allocated row of this pool")
        self.blocks.release(row)
        self._free.append(row)
