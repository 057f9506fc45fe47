"""The gated MLP: ``down(act(gate x, up x))``, gate and up column-parallel, down row-parallel.

DeepSeek V4's shared expert and Kimi K3's dense MLP / shared experts are this same block; each
model keeps its own module so the parameters carry its checkpoint's names (``w1``/``w3``/``w2``
vs ``gate_proj``/``up_proj``/``down_proj``), and builds and runs the projections through here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sglang.srt.layers.activation import Activation, act_and_mul
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.linear import ColumnParallelLinear, RowParallelLinear
from sglang.srt.layers.quantization.fp8_linear import gated_act_quant


def gated_mlp_projections(
    hidden_size: int,
    intermediate_size: int,
    spec: LayerBuildSpec,
    *,
    reduce_results: bool,
) -> tuple[ColumnParallelLinear, ColumnParallelLinear, RowParallelLinear]:
    """``(gate, up, down)``; ``reduce_results=False`` leaves down's all-reduce to the caller."""
    return (
        ColumnParallelLinear(hidden_size, intermediate_size, spec),
        ColumnParallelLinear(hidden_size, intermediate_size, spec),
        RowParallelLinear(intermediate_size, hidden_size, spec, reduce_results=reduce_results),
    )


def gated_mlp_forward(
    x: Tensor,
    gate: ColumnParallelLinear,
    up: ColumnParallelLinear,
    down: RowParallelLinear,
    activation: Activation,
    *,
    swiglu_limit: float | None = None,
    fuse_act_quant: bool = False,
) -> Tensor:
    """``fuse_act_quant`` (FP8 ``down`` only): the activation writes ``down``'s FP8 input in the
    same launch."""
    xa = gate.prepare_input(x) if gate.fp8 and up.fp8 else x  # FP8: one quantisation for both
    if fuse_act_quant and down.fp8:
        return down(gated_act_quant(gate(xa), up(xa), activation, swiglu_limit))
    # gate and up are concatenated so the activation (Triton on CUDA) reads one tensor.
    gate_up = torch.cat([gate(xa), up(xa)], dim=-1)
    return down(act_and_mul(gate_up, activation, swiglu_limit=swiglu_limit))
