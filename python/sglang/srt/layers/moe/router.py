"""The linear router of an MoE block: ``weight [E, H]`` in the model dtype, logits in fp32.

DeepSeek V4's gate and Kimi K3's router both score experts this way; they differ only in what
steers the selection (a bias under their checkpoint's name, or V4's hash table), which their
subclasses add.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.linear import frozen_param


class LinearRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, spec: LayerBuildSpec) -> None:
        super().__init__()
        self.weight = frozen_param(
            torch.empty(num_experts, hidden_size, dtype=spec.dtype, device=spec.device)
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 router logits ``[T, E]`` (fp32 accumulation of the model-dtype operands): near-tied
        experts are decided in fp32."""
        return F.linear(x.float(), self.weight.float())
