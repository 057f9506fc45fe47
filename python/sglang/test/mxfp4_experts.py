"""Random MXFP4 routed experts and routing for the W4A16 MoE tests and benchmarks.

Every 4-bit code is drawn uniformly (all 16, both zeros included), and each 32-value group gets a
UE8M0 scale drawn from a 4-octave range placed so that a row's dot product with unit-variance
activations stays of order one (as in a trained layer: ``2**e ~ 1 / (2.6 * sqrt(K))``, 2.6 the RMS
of a uniform E2M1 code). Scale bytes are never 0 or 255.
"""

from __future__ import annotations

import math

import torch

from sglang.kernels.ops.quant.mxfp4 import UE8M0_BIAS

E2M1_CODE_RMS = 2.6  # sqrt(mean of the 16 codes' squares) = sqrt(6.78)
SCALE_OCTAVES = 4


def random_mxfp4(
    shape: tuple[int, ...], gen: torch.Generator, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed uint8 ``[..., K/2]`` and UE8M0 scales uint8 ``[..., K/32]`` for weights ``shape``
    ``[..., K]``."""
    *lead, k = shape
    packed = torch.randint(0, 256, (*lead, k // 2), generator=gen, device=device, dtype=torch.int32)
    top = -math.ceil(math.log2(E2M1_CODE_RMS * math.sqrt(k))) + 2
    exps = torch.randint(
        top - SCALE_OCTAVES, top + 1, (*lead, k // 32), generator=gen, device=device
    )
    return packed.to(torch.uint8), (exps + UE8M0_BIAS).to(torch.uint8)


def random_mxfp4_experts(
    num_experts: int,
    hidden: int,
    inter: int,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w13 [E, 2I, H/2], w2 [E, H, I/2], w13_scale [E, 2I, H/32], w2_scale [E, H, I/32])`` in
    the checkpoint layout (rows ``[gate; up]``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w13, s13 = random_mxfp4((num_experts, 2 * inter, hidden), gen, device)
    w2, s2 = random_mxfp4((num_experts, hidden, inter), gen, device)
    return w13, w2, s13, s2


def random_routing(
    tokens: int,
    hidden: int,
    num_experts: int,
    top_k: int,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    masked: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden [T, H] ~ N(0, 1), topk_weights fp32 [T, k] summing to 1, topk_ids int32 [T, k])``:
    uniform random distinct experts per token; a fraction ``masked`` of the slots set to -1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    scores = torch.rand(tokens, num_experts, generator=gen, device=device) + 0.05
    weights, ids = torch.topk(scores, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    if masked:
        drop = torch.rand(ids.shape, generator=gen, device=device) < masked
        ids = torch.where(drop, -1, ids)
    return x, weights.float(), ids.to(torch.int32)
