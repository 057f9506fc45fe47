"""Token embedding, replicated on every rank (a vocab-parallel split would only save memory)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.linear import frozen_param


class ReplicatedEmbedding(nn.Module):
    """Token embedding table ``[vocab, H]``."""

    def __init__(self, vocab: int, hidden: int, spec: LayerBuildSpec) -> None:
        super().__init__()
        self.weight = frozen_param(torch.empty(vocab, hidden, dtype=spec.dtype, device=spec.device))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
