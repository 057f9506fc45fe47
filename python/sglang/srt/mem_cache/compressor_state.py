"""Per-request state of one KV compressor (DeepSeek V4 ratio-4 / ratio-128 layers and the ratio-4
indexer): the emitted compressed entries and what the next entry still needs.

An entry pools one block of ``ratio`` consecutive tokens, so tokens of a block that is not complete
yet wait in ``pending_*`` (their projected ``kv`` / ``score`` rows, fp32). With overlapping windows
(ratio 4) an entry also pools the *previous* block's tokens through their first channel half, so
the last complete block's first halves are kept in ``prev_*``.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.growable_rows import GrowableRows


class CompressorState:
    def __init__(
        self,
        *,
        ratio: int,
        dim: int,
        overlap: bool,
        entry_dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if ratio < 1:
            raise ValueError(f"compress ratio must be >= 1, got {ratio}")
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        width = (2 if overlap else 1) * dim
        self.pending_kv = torch.zeros(0, width, dtype=torch.float32, device=device)
        self.pending_score = torch.zeros(0, width, dtype=torch.float32, device=device)
        self.prev_kv: torch.Tensor | None = None  # [ratio, dim] fp32, overlap only
        self.prev_score: torch.Tensor | None = None
        self.entries = GrowableRows(dim, dtype=entry_dtype, device=device)

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    @property
    def num_tokens(self) -> int:
        """Tokens consumed so far (complete blocks plus pending rows)."""
        return self.num_entries * self.ratio + self.pending_kv.shape[0]

    def take_complete_blocks(
        self, kv: torch.Tensor, score: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Add new rows; return the rows of every block completed now as
        ``(kv [nb, ratio, width], score [nb, ratio, width], first_block_index)``, keeping the
        remainder pending."""
        rows_kv = torch.cat([self.pending_kv, kv.float()])
        rows_score = torch.cat([self.pending_score, score.float()])
        nb = rows_kv.shape[0] // self.ratio
        used = nb * self.ratio
        self.pending_kv, self.pending_score = rows_kv[used:].clone(), rows_score[used:].clone()
        width = rows_kv.shape[1]
        first = self.num_entries
        return (
            rows_kv[:used].view(nb, self.ratio, width),
            rows_score[:used].view(nb, self.ratio, width),
            first,
        )
