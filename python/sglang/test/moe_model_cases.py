"""Fused-MoE problems at the real model shapes, for the GPU tests of every MoE kernel and runner:
DeepSeek V4 experts (E=256, top-6, H=4096, I=2048, clamped SwiGLU) and Kimi K3 latent experts
(E=384, top-16, H=3584, I=3072, SiTU), random bf16 or FP8 (128x128 block) expert weights, random
routing with masked slots and one fully masked token, and a NaN-poisoned allocator so a row a
kernel forgets to write shows up."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

BF16_TOL = 2e-2
FP8_TOL = 6e-2
M_VALUES = (1, 7, 64, 512)


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    swiglu_limit: float  # used when the activation is swiglu with a clamp


SHAPES = {
    "dsv4": Shape("dsv4", 256, 6, 4096, 2048, 1.0),
    "k3": Shape("k3", 384, 16, 3584, 3072, 1.0),
}
# (activation, clamp?) per shape: each model's own activation plus the other one.
ACTIVATIONS = {
    "dsv4": [("swiglu", True), ("situ", False)],
    "k3": [("situ", False), ("swiglu", False)],
}


def poison_allocator(nbytes: int, device: torch.device) -> None:
    """Fill memory the caching allocator will hand out next with NaN bytes."""
    junk = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    junk.fill_(float("nan"))
    del junk


_CACHE: dict[tuple[str, bool], dict[str, Any]] = {}


def expert_weights(shape: Shape, fp8: bool) -> dict[str, Any]:
    """Random expert weights, cached for one shape at a time (they take tens of GB)."""
    key = (shape.name, fp8)
    if key not in _CACHE:
        for old in [k for k in _CACHE if k[0] != shape.name]:
            del _CACHE[old]
        torch.cuda.empty_cache()
        if (shape.name, False) not in _CACHE:
            g = torch.Generator(device="cuda").manual_seed(1234)
            e, h, i = shape.experts, shape.hidden, shape.inter
            w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g)
            w13.mul_(1.0 / math.sqrt(h))
            w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g)
            w2.mul_(1.0 / math.sqrt(i))
            _CACHE[(shape.name, False)] = {"w13": w13, "w2": w2}
        if fp8:
            from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8

            base = _CACHE[(shape.name, False)]
            q13, s13 = block_quant_weight_fp8(base["w13"], (128, 128))
            q2, s2 = block_quant_weight_fp8(base["w2"], (128, 128))
            _CACHE[key] = {
                "w13": q13,
                "w2": q2,
                "w13_scale": s13,
                "w2_scale": s2,
                "block_shape": (128, 128),
            }
    return _CACHE[key]


def routing(
    tokens: int, shape: Shape, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    scores = torch.rand(tokens, shape.experts, device="cuda", generator=g) + 0.05
    weights, ids = torch.topk(scores, shape.top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).float()
    masked = torch.rand(ids.shape, device="cuda", generator=g) < 0.05
    ids = torch.where(masked, -1, ids)
    if tokens > 2:
        ids[tokens // 2] = -1  # a token with every slot masked must come out as zeros
    return hidden, weights, ids.to(torch.int32)
