"""Token embedding, replicated on every rank (a vocab-parallel split would only save memory)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.linear import attach_loader, default_weight_loader


class ReplicatedEmbedding(nn.Module):
    """Token embedding table ``[vocab, H]``."""

    def __init__(
        self, vocab: int, hidden: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        w = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype, device=device), requires_grad=False)
        self.weight = attach_loader(w, default_weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
