"""The gated MLP: ``down(act(gate x, up x))``, gate and up column-parallel, down row-parallel.

DeepSeek V4's shared expert and Kimi K3's dense MLP / shared experts are this same block; each
model keeps its own module so the parameters carry its checkpoint's names (``w1``/``w3``/``w2``
vs ``gate_proj``/``up_proj``/``down_proj``), and builds and runs the projections through here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sglang.srt.layers.activation import Activation, act_and_mul
from sglang.srt.layers.linear import ColumnParallelLinear, RowParallelLinear


def gated_mlp_projections(
    hidden_size: int,
    intermediate_size: int,
    *,
    reduce_results: bool,
    params_dtype: torch.dtype,
    tp_rank: int = 0,
    tp_size: int = 1,
    device: torch.device | str | None = None,
) -> tuple[ColumnParallelLinear, ColumnParallelLinear, RowParallelLinear]:
    """``(gate, up, down)``; ``reduce_results=False`` leaves down's all-reduce to the caller."""
    col: dict[str, Any] = {
        "params_dtype": params_dtype,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "device": device,
    }
    return (
        ColumnParallelLinear(hidden_size, intermediate_size, **col),
        ColumnParallelLinear(hidden_size, intermediate_size, **col),
        RowParallelLinear(intermediate_size, hidden_size, reduce_results=reduce_results, **col),
    )


def gated_mlp_forward(
    x: Tensor,
    gate: ColumnParallelLinear,
    up: ColumnParallelLinear,
    down: RowParallelLinear,
    activation: Activation,
    *,
    swiglu_limit: float | None = None,
) -> Tensor:
    # gate and up are concatenated so the activation (Triton on CUDA) reads one tensor.
    gate_up = torch.cat([gate(x), up(x)], dim=-1)
    return down(act_and_mul(gate_up, activation, swiglu_limit=swiglu_limit))
