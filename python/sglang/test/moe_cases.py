"""Small random fused-MoE problems for the CPU tests of the MoE kernels (the interpreter runs
them): the activations every kernel takes, and tokens, expert weights (fp32, bf16 or FP8 with
128x128 block scales) and routing with masked slots."""

from __future__ import annotations

import math
from typing import Any

import torch

# (activation, clamp): SwiGLU plain and clamped, and SiTU.
ACTS = [("swiglu", None), ("swiglu", 0.75), ("situ", None)]


def make_moe(
    tokens: int,
    experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    fp8: bool,
    seed: int = 0,
    masked: float = 0.1,
) -> dict[str, Any]:
    from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=g)).to(dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / math.sqrt(hidden)
    w2 = torch.randn(experts, hidden, inter, generator=g) / math.sqrt(inter)
    scores = torch.rand(tokens, experts, generator=g)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    ids = torch.where(torch.rand(ids.shape, generator=g) < masked, -1, ids).to(torch.int32)
    moe: dict[str, Any] = {"hidden": x, "topk_weights": weights.float(), "topk_ids": ids}
    if fp8:
        q13, s13 = block_quant_weight_fp8(w13, (128, 128))
        q2, s2 = block_quant_weight_fp8(w2, (128, 128))
        moe.update(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2, block_shape=(128, 128))
    else:
        moe.update(w13=w13.to(dtype), w2=w2.to(dtype))
    return moe
