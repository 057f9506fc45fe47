"""Kimi K3's gated MLP: the dense layer-0 FFN and the shared experts.

``down_proj(act(gate_proj x, up_proj x))`` with SiTU (or SwiGLU for ``hidden_act="silu"``); gate
and up are column-parallel, down row-parallel and reducing (a replicated MLP under expert
parallelism, ``tp_size=1``, has nothing to reduce).
"""

from __future__ import annotations

from torch import Tensor, nn

from sglang.srt.layers.activation import Activation
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.mlp import gated_mlp_forward, gated_mlp_projections


class KimiK3MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        spec: LayerBuildSpec,
        *,
        activation: Activation,
    ) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gated_mlp_projections(
            hidden_size, intermediate_size, spec, reduce_results=True
        )
        self.activation: Activation = activation

    def forward(self, x: Tensor) -> Tensor:
        return gated_mlp_forward(x, self.gate_proj, self.up_proj, self.down_proj, self.activation)
