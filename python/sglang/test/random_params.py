"""Random parameters for the benchmarks' models (no checkpoint): matrices scaled by
``1/sqrt(fan_in)`` so activations keep their size through the layers, norm weights 1, every other
vector ``N(0, vector_scale^2)``."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def randomize_params_(model: nn.Module, gen: torch.Generator, *, vector_scale: float) -> None:
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.copy_(
                torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
                * p.shape[-1] ** -0.5
            )
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            p.copy_(noise * vector_scale)
