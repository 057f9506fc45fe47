"""Per-request state of one KV compressor (DeepSeek V4 ratio-4 / ratio-128 layers and the ratio-4
indexer): the emitted compressed entries and what the next entry still needs.

An entry pools one block of ``ratio`` consecutive tokens, so tokens of a block that is not complete
yet wait in ``pending_*`` (their projected ``kv`` / ``score`` rows, fp32; row ``p % ratio`` holds
position ``p``). With overlapping windows (ratio 4) an entry also pools the *previous* block's
tokens through their first channel half, so the last complete block's first halves (scores with
``ape`` added) are kept in ``prev_*``; before block 0 completes they are zero rows with ``-inf``
scores, which the pooling softmax weighs 0 -- exactly "no previous block".

Every pending / previous buffer has a fixed shape, so the state can live in a slot of the static
pool (:class:`CompressorStorage` views, entries paged in the pool's blocks; the static decode
updates them in place with masks) or in its own tensors (a plain per-request cache). Host
counters (pending rows, entries) are the eager path's; the static decode keeps them right through
:meth:`sync_to`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.growable_rows import GrowableRows
from sglang.srt.mem_cache.row_codec import PlainRows, RowCodec


@dataclass(frozen=True)
class CompressorStorage:
    """One request's compressor buffers: ``entries`` (stored rows ``[n, width]``, paged in the
    pool's blocks; ``encoding`` says how), ``pending_kv`` /
    ``pending_score [ratio, coff*D]`` fp32, ``prev_kv`` / ``prev_score [ratio, D]`` fp32 (overlap
    only, else ``None``)."""

    entries: GrowableRows
    pending_kv: torch.Tensor
    pending_score: torch.Tensor
    prev_kv: torch.Tensor | None
    prev_score: torch.Tensor | None
    encoding: RowCodec


def reset_previous(prev_kv: torch.Tensor, prev_score: torch.Tensor) -> None:
    """The "no previous block" rows: kv 0, score -inf (softmax weight 0)."""
    prev_kv.zero_()
    prev_score.fill_(float("-inf"))


class CompressorState:
    def __init__(
        self,
        *,
        ratio: int,
        dim: int,
        overlap: bool,
        entry_dtype: torch.dtype,
        device: torch.device | str = "cpu",
        storage: CompressorStorage | None = None,
        encoding: RowCodec | None = None,
    ) -> None:
        """Entries of ``dim`` values in ``entry_dtype`` (the model dtype), or stored as
        ``encoding`` says (FP8 rows); with ``storage`` its encoding is the entries'."""
        if ratio < 1:
            raise ValueError(f"compress ratio must be >= 1, got {ratio}")
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        width = (2 if overlap else 1) * dim
        self.entries: GrowableRows
        self.encoding: RowCodec = encoding or PlainRows(dim, entry_dtype)
        if storage is None:
            f32 = torch.float32
            self._pending_kv = torch.zeros(ratio, width, dtype=f32, device=device)
            self._pending_score = torch.zeros(ratio, width, dtype=f32, device=device)
            self.prev_kv: torch.Tensor | None = None
            self.prev_score: torch.Tensor | None = None
            if overlap:
                self.prev_kv = torch.empty(ratio, dim, dtype=f32, device=device)
                self.prev_score = torch.empty(ratio, dim, dtype=f32, device=device)
                reset_previous(self.prev_kv, self.prev_score)
            enc = self.encoding
            self.entries = GrowableRows(enc.width, dtype=enc.store_dtype, device=device)
        else:
            self._pending_kv, self._pending_score = storage.pending_kv, storage.pending_score
            self.prev_kv, self.prev_score = storage.prev_kv, storage.prev_score
            self.entries = storage.entries
            self.encoding = storage.encoding
        self.num_pending = 0

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    def entry_values(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Every entry ``[n, dim]``, decoded (``dtype``: default the model dtype)."""
        return self.encoding.decode(self.entries.rows(), dtype)

    @property
    def num_tokens(self) -> int:
        """Tokens consumed so far (complete blocks plus pending rows)."""
        return self.num_entries * self.ratio + self.num_pending

    @property
    def pending_kv(self) -> torch.Tensor:
        return self._pending_kv[: self.num_pending]

    @property
    def pending_score(self) -> torch.Tensor:
        return self._pending_score[: self.num_pending]

    @property
    def pending_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole ``[ratio, coff*D]`` pending buffers (rows ``0 .. num_pending`` are used)."""
        return self._pending_kv, self._pending_score

    def finish_blocks(
        self, kv: torch.Tensor, score: torch.Tensor, nb: int, ape: torch.Tensor
    ) -> None:
        """After a kernel pooled ``nb`` blocks from the pending rows and the new ``kv`` /
        ``score`` rows without writing the state (``compress_prefill``): with overlap the last
        block's first halves (scores plus ``ape``) become the previous block, and the rows past
        the blocks become the pending rows; the same values :meth:`take_complete_blocks` and
        ``KVCompressor.append``'s torch path leave. The entries are the caller's to append."""
        ratio, pend, new = self.ratio, self.num_pending, kv.shape[0]
        if nb and self.overlap:
            assert self.prev_kv is not None and self.prev_score is not None
            d, start = self.dim, (nb - 1) * ratio - pend  # the last block's first row in ``kv``
            if start >= 0:
                last_kv, last_score = kv[start : start + ratio, :d], score[start : start + ratio]
                last_score = last_score[:, :d]
            else:  # one block, begun in the pending rows
                last_kv = torch.cat([self._pending_kv[:pend, :d], kv[: ratio - pend, :d]])
                last_score = torch.cat([self._pending_score[:pend, :d], score[: ratio - pend, :d]])
            self.prev_kv.copy_(last_kv)
            torch.add(last_score, ape.float()[:, :d], out=self.prev_score)
        if nb:
            left = nb * ratio - pend  # the first row of ``kv`` not in a block
            rest = new - left
            self._pending_kv[:rest] = kv[left:]
            self._pending_score[:rest] = score[left:]
        else:
            rest = pend + new
            self._pending_kv[pend:rest] = kv
            self._pending_score[pend:rest] = score
        self.num_pending = rest

    def sync_to(self, num_tokens: int) -> None:
        """Set the host counters for ``num_tokens`` consumed tokens (after a static decode wrote
        the buffers itself)."""
        self.entries.n = num_tokens // self.ratio
        self.num_pending = num_tokens % self.ratio

    def set_previous(self, kv: torch.Tensor, score: torch.Tensor) -> None:
        """Keep the last complete block's first halves ``[ratio, D]`` (in place)."""
        assert self.prev_kv is not None and self.prev_score is not None
        self.prev_kv.copy_(kv)
        self.prev_score.copy_(score)

    def take_complete_blocks(
        self, kv: torch.Tensor, score: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Add new rows; return the rows of every block completed now as
        ``(kv [nb, ratio, width], score [nb, ratio, width], first_block_index)``, keeping the
        remainder pending (rows ``0 ..`` of the pending buffers: blocks align to positions)."""
        rows_kv = torch.cat([self.pending_kv, kv.float()])
        rows_score = torch.cat([self.pending_score, score.float()])
        nb = rows_kv.shape[0] // self.ratio
        used = nb * self.ratio
        rest = rows_kv.shape[0] - used
        self._pending_kv[:rest] = rows_kv[used:]
        self._pending_score[:rest] = rows_score[used:]
        self.num_pending = rest
        width = rows_kv.shape[1]
        first = self.num_entries
        return (
            rows_kv[:used].view(nb, self.ratio, width),
            rows_score[:used].view(nb, self.ratio, width),
            first,
        )
