"""The preallocated, paged cache of DeepSeek V4: every running request owns one *slot* (a row of
its fixed-size state) and the blocks of a shared pool its live length needs, so a decode step has
fixed shapes (a CUDA graph can capture it) while memory follows live tokens.

Per slot (``S = max_slots + 1`` rows; the last slot is scratch, where a padded batch's padding
rows write, so they never touch a real request), per layer, the fixed-size state:
- ``window [S, W, D]``: the sliding-window ring, row ``p % W`` holds position ``p`` (``W`` rows
  whatever the length, so it stays a per-slot row, like Kimi K3's KDA state);
- per compressor (ratio 4 / 128; plus the ratio-4 indexer's own): ``pending_kv`` /
  ``pending_score [S, ratio, coff*D]`` fp32 and, with overlapping windows, ``prev_kv`` /
  ``prev_score [S, ratio, D]`` fp32.
Paged, per compressor: ``entries [num_blocks + 1, B // ratio, width]`` (``D`` values of the model
dtype, or FP8 rows of ``width`` bytes: ``--kv-cache-dtype``), where a block of ``B`` tokens
(``block_tokens``, a multiple of every ratio) holds those tokens' entries. One block table
(:class:`PagedBlockTable`, ``[S, ceil(capacity / B)]`` on the device) serves every layer: a
request's block ``i`` holds its entries of tokens ``i * B ..`` in every compressor. The extra
block is the null block that unused table entries (and the scratch slot) point to.

The eager path reaches a slot through views and :class:`PagedRows` (:meth:`request_cache`),
the static decode through the whole tensors indexed by device tensors of slots and the table: both
write the same storage, so a request prefilled eagerly decodes in a graph with no copy. Lengths
are the callers' (host counts for the eager path, device positions for the static decode); the
caller gives a request its blocks before a forward writes them (:meth:`reserve`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from sglang.srt.mem_cache.compressor_state import (
    CompressorState,
    CompressorStorage,
    reset_previous,
)
from sglang.srt.mem_cache.deepseek_v4_cache import (
    CompressorShape,
    DeepseekV4CacheShape,
    DeepseekV4LayerCache,
    DeepseekV4RequestCache,
)
from sglang.srt.mem_cache.paged_block_table import PagedBlockTable
from sglang.srt.mem_cache.paged_rows import PagedRows
from sglang.srt.mem_cache.row_codec import PlainRows, RowCodec
from sglang.srt.mem_cache.slot_blocks import DEFAULT_BLOCK_TOKENS, SlotBlocks, SlotPoolSize
from sglang.srt.mem_cache.window_ring import WindowRing


@dataclass(frozen=True)
class CompressorSlots:
    ratio: int
    overlap: bool
    entries: torch.Tensor  # [num_blocks + 1, B // ratio, encoding.width] stored rows
    pending_kv: torch.Tensor
    pending_score: torch.Tensor
    prev_kv: torch.Tensor | None
    prev_score: torch.Tensor | None
    encoding: RowCodec

    @property
    def dim(self) -> int:
        """Values an entry holds."""
        return self.encoding.dim

    @classmethod
    def allocate(
        cls,
        slots: int,
        num_blocks: int,
        block_tokens: int,
        ratio: int,
        dim: int,
        *,
        overlap: bool,
        dtype: torch.dtype,
        device: torch.device,
        encoding: RowCodec | None = None,
    ) -> CompressorSlots:
        """Entries in ``dtype`` (the model dtype), or stored as ``encoding`` says (FP8 rows)."""
        width = (2 if overlap else 1) * dim
        encoding = encoding or PlainRows(dim, dtype)

        def f32(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.float32, device=device)

        # Only overlapping windows keep the previous block (readers treat None as "no overlap"),
        # so ratio-128 layers allocate nothing for it.
        prev_kv = f32(slots, ratio, dim) if overlap else None
        prev_score = f32(slots, ratio, dim) if overlap else None
        return cls(
            ratio=ratio,
            overlap=overlap,
            # +1: the null block (see the module doc)
            entries=torch.zeros(
                num_blocks + 1,
                block_tokens // ratio,
                encoding.width,
                dtype=encoding.store_dtype,
                device=device,
            ),
            pending_kv=f32(slots, ratio, width),
            pending_score=f32(slots, ratio, width),
            prev_kv=prev_kv,
            prev_score=prev_score,
            encoding=encoding,
        )

    def storage(self, slot: int, table: PagedBlockTable) -> CompressorStorage:
        return CompressorStorage(
            PagedRows(self.entries, table.table[slot], table.blocks(slot)),
            self.pending_kv[slot],
            self.pending_score[slot],
            None if self.prev_kv is None else self.prev_kv[slot],
            None if self.prev_score is None else self.prev_score[slot],
            self.encoding,
        )

    def reset(self, slot: int) -> None:
        # Only the "previous block" rows carry meaning before the first write; the rest is
        # read under masks (pending rows, entries) and may hold a former owner's values.
        if self.prev_kv is not None and self.prev_score is not None:
            reset_previous(self.prev_kv[slot], self.prev_score[slot])

    def nbytes(self) -> int:
        parts = (self.entries, self.pending_kv, self.pending_score, self.prev_kv, self.prev_score)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclass(frozen=True)
class LayerSlots:
    window: torch.Tensor
    compressor: CompressorSlots | None
    indexer: CompressorSlots | None


def default_block_tokens(compress_ratios: tuple[int, ...]) -> int:
    """The smallest multiple of every ratio that is >= ``DEFAULT_BLOCK_TOKENS``: a block is a
    whole number of entries of every compressor, and a block edge is where no compressor has
    pending rows."""
    step = math.lcm(*[r for r in compress_ratios if r > 0], 1)
    return step * -(-DEFAULT_BLOCK_TOKENS // step)


class DeepseekV4SlotPool(SlotBlocks):
    def __init__(
        self, shape: DeepseekV4CacheShape, size: SlotPoolSize, *, device: torch.device | str = "cpu"
    ) -> None:
        """A pool of ``size`` (blocks of :func:`default_block_tokens` unless it says otherwise).
        The window rings are the model dtype; the compressed entries and indexer keys are stored
        as the shape's codecs say."""
        dev = torch.device(device)
        self.shape = shape
        self.window = shape.sliding_window
        block_tokens = size.block_tokens or default_block_tokens(shape.compress_ratios)
        bad = [r for r in shape.compress_ratios if r > 0 and block_tokens % r]
        if bad:
            raise ValueError(
                f"block_tokens {block_tokens} is not a multiple of the compress ratios {bad}"
            )
        super().__init__(replace(size, block_tokens=block_tokens), device=dev)
        rows = self.rows
        nb, bt = self.block_pool.num_blocks, self.block_tokens

        def slots(comp: CompressorShape | None) -> CompressorSlots | None:
            if comp is None:
                return None
            return CompressorSlots.allocate(
                rows,
                nb,
                bt,
                comp.ratio,
                comp.dim,
                overlap=comp.overlap,
                dtype=shape.dtype,
                device=dev,
                encoding=comp.codec,
            )

        self.layers: list[LayerSlots] = []
        for comp, idx in shape.layer_compressors():
            window = torch.zeros(
                rows, shape.sliding_window, shape.head_dim, dtype=shape.dtype, device=dev
            )
            self.layers.append(LayerSlots(window, slots(comp), slots(idx)))
        for slot in range(rows):
            self._reset(slot)

    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            total += layer.window.numel() * layer.window.element_size()
            for comp in (layer.compressor, layer.indexer):
                total += comp.nbytes() if comp is not None else 0
        return total + self.table_nbytes()

    def edge_state(self) -> list[torch.Tensor]:
        """At a block edge (a multiple of every ratio) no compressor has pending rows, so a
        request's state besides its blocks is every layer's window ring and, with overlapping
        windows, the last complete block's first halves (``prev_*``)."""
        state: list[torch.Tensor] = []
        for layer in self.layers:
            state.append(layer.window)
            for comp in (layer.compressor, layer.indexer):
                if comp is not None and comp.prev_kv is not None and comp.prev_score is not None:
                    state += [comp.prev_kv, comp.prev_score]
        return state

    def request_cache(self, slot: int) -> DeepseekV4RequestCache:
        """An empty cache over ``slot`` (the caller allocated it): views of its window ring and
        its compressor and indexer state, which the eager forward reads and writes in place."""

        def state(c: CompressorSlots | None) -> CompressorState | None:
            if c is None:
                return None
            return CompressorState(
                ratio=c.ratio,
                dim=c.dim,
                overlap=c.overlap,
                entry_dtype=c.encoding.dtype,
                storage=c.storage(slot, self.blocks),
            )

        layers = []
        for store in self.layers:
            ring = WindowRing(
                self.window,
                store.window.shape[-1],
                dtype=store.window.dtype,
                buf=store.window[slot],
            )
            layers.append(DeepseekV4LayerCache(ring, state(store.compressor), state(store.indexer)))
        cache = DeepseekV4RequestCache(layers)
        cache.slot = slot
        return cache

    def _reset(self, slot: int) -> None:
        for layer in self.layers:
            for comp in (layer.compressor, layer.indexer):
                if comp is not None:
                    comp.reset(slot)
