"""KDA's non-linear parameters and how a rank loads its slice of them.

All are fp32 in the checkpoint and stay fp32: the conv weights, ``dt_bias`` and ``A_log`` feed
the decay, whose errors compound over the sequence. Each is split by head along dim 0, like the
column-parallel q/k/v projections they follow.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.linear import (
    WeightShapeError,
    dim0_sharded_param,
    frozen_param,
    per_rank,
    tp_slice,
)
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)


class ShortConvWeight(nn.Module):
    """One depthwise conv's weight, ``[C, 1, W]`` in the checkpoint (``q_conv1d.weight`` ...),
    kept as this rank's ``[C_local, 1, W]``."""

    def __init__(self, channels: int, width: int, spec: LayerBuildSpec) -> None:
        super().__init__()
        self.weight = dim0_sharded_param((channels, 1, width), spec)


def a_log_param(num_heads: int, spec: LayerBuildSpec) -> nn.Parameter:
    """Per-head ``A_log`` (this rank's heads). Accepted checkpoint shapes: ``[H]``,
    ``[1, 1, H, 1]`` (Kimi Linear / fla), and a longer vector ``[N > H]``: the released K3
    checkpoint stores ``[head_dim]`` for 96 heads and SGLang uses its first ``H`` entries per head
    (open question 1 of the design notes); we do the same and say so once."""
    tp_rank, tp_size = spec.tp_rank, spec.tp_size
    local_heads = per_rank(num_heads, tp_size, "KDA heads")

    def load(param: nn.Parameter, full: torch.Tensor) -> None:
        flat = (
            full.reshape(-1)
            if full.dim() == 4 and full.shape[:2] == (1, 1) and full.shape[3] == 1
            else full
        )
        if flat.dim() != 1 or flat.shape[0] < num_heads:
            raise WeightShapeError(
                f"expected shape ({num_heads},), (1, 1, {num_heads}, 1) or a longer vector, got "
                f"{tuple(full.shape)}"
            )
        if flat.shape[0] > num_heads:
            log_once(
                logger,
                logging.INFO,
                f"A_log has {flat.shape[0]} entries for {num_heads} KDA heads: using the first "
                f"{num_heads}, per head",
            )
            flat = flat[:num_heads]
        with torch.no_grad():
            param.copy_(tp_slice(flat, 0, tp_rank, tp_size).to(param.dtype))

    return frozen_param(torch.zeros(local_heads, dtype=torch.float32, device=spec.device), load)
