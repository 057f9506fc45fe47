"""Kimi K3's gated MLP: the dense layer-0 FFN and the shared experts.

``down_proj(act(gate_proj x, up_proj x))`` with SiTU (or SwiGLU for ``hidden_act="silu"``); gate
and up are column-parallel, down row-parallel. ``reduce_results=False`` leaves the all-reduce to
the caller (a replicated MLP under expert parallelism needs none either way).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from sglang.srt.layers.activation import Activation, act_and_mul
from sglang.srt.layers.linear import ColumnParallelLinear, RowParallelLinear


class KimiK3MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: Activation,
        params_dtype: torch.dtype,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce_results: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        col: dict[str, Any] = {
            "params_dtype": params_dtype,
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "device": device,
        }
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, **col)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, **col)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, reduce_results=reduce_results, **col
        )
        self.activation: Activation = activation

    def forward(self, x: Tensor) -> Tensor:
        gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        return self.down_proj(act_and_mul(gate_up, self.activation))
