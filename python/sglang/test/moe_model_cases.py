"""Fused-MoE problems at the real model shapes, for the GPU tests of every MoE kernel and runner:
DeepSeek V4 experts (E=256, top-6, H=4096, I=2048, clamped SwiGLU) and Kimi K3 latent experts
(E=384, top-16, H=3584, I=3072, SiTU), random bf16 or FP8 (128x128 block) expert weights, random
routing with masked slots and one fully masked token, and a NaN-poisoned allocator so a row a
kernel forgets to write shows up."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

BF16_TOL = 2e-2
FP8_TOL = 6e-2
M_VALUES = (1, 7, 64, 512)


@dataclass(frozen=True)
class Shape:
    """One model's routed experts (the MoE tests' and benchmarks' problem): ``experts`` of width
    ``inter`` on ``hidden``, ``top_k`` a token, ``activation`` the model's own; ``swiglu_limit``
    clamps a "swiglu" activation where a run clamps it (None: unclamped)."""

    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    activation: str
    swiglu_limit: float | None = None


SHAPES = {
    "dsv4": Shape("dsv4", 256, 6, 4096, 2048, "swiglu", 1.0),
    "k3": Shape("k3", 384, 16, 3584, 3072, "situ", 1.0),
}
# (activation, clamp?) per shape: each model's own activation plus the other one.
ACTIVATIONS = {
    "dsv4": [("swiglu", True), ("situ", False)],
    "k3": [("situ", False), ("swiglu", False)],
}

# Every (shape name, fp8, M) of the MoE kernels' reference checks (:func:`reference_cases`), and
# readable test ids for them ("dsv4-fp8-64").
REFERENCE_GRID = [(name, fp8, m) for name in SHAPES for fp8 in (False, True) for m in M_VALUES]
REFERENCE_IDS = [f"{name}-{'fp8' if fp8 else 'bf16'}-{m}" for name, fp8, m in REFERENCE_GRID]


def poison_allocator(nbytes: int, device: torch.device | str) -> None:
    """Fill memory the caching allocator will hand out next with NaN bytes."""
    junk = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    junk.fill_(float("nan"))
    del junk


def poison_moe_workspace(
    m: int, shape: Shape, device: torch.device | str, extra: int = 1 << 20
) -> None:
    """Poison as much memory as an MoE call on ``m`` tokens of ``shape`` takes for its
    intermediates (8 bytes a routed slot and column), plus ``extra`` bytes."""
    poison_allocator(m * shape.top_k * (shape.hidden + shape.inter) * 8 + extra, device)


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


def tolerance(fp8: bool) -> float:
    """Relative (Frobenius) error bound of a kernel's bf16 output against the torch reference."""
    return FP8_TOL if fp8 else BF16_TOL


@dataclass(frozen=True)
class ReferenceCase:
    """One routed batch with one activation, and the torch reference's output for it."""

    tag: str  # shape, dtype, M and activation, for messages
    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    kwargs: dict[str, Any]  # the expert weights, activation and SwiGLU limit
    want: torch.Tensor
    tol: float

    def check(self, out: torch.Tensor) -> float:
        """Every row written and finite, within ``tol`` of the reference, and the fully masked
        token zero; returns the relative error."""
        from sglang.test.tolerance import rel_norm_err

        assert torch.isfinite(out).all(), f"{self.tag}: unwritten or NaN rows"
        err = rel_norm_err(out, self.want)
        assert err < self.tol, f"{self.tag}: rel err {err:.3g}"
        m = out.shape[0]
        if m > 2:
            assert (out[m // 2] == 0).all(), f"{self.tag}: a fully masked token must be zero"
        return err


def reference_cases(shape_name: str, fp8: bool, m: int) -> Iterator[ReferenceCase]:
    """``m`` routed tokens for each activation ``ACTIVATIONS`` gives the shape (fresh routing a
    case), with the torch reference's output."""
    from sglang.kernels.ops.moe.fused_moe import fused_experts_torch

    shape = SHAPES[shape_name]
    weights = expert_weights(shape, fp8)
    for n, (activation, clamp) in enumerate(ACTIVATIONS[shape_name]):
        limit = shape.swiglu_limit if clamp else None
        hidden, topk_w, topk_ids = routing(m, shape, seed=m * 10 + n + (100 if fp8 else 0))
        kw = dict(weights, activation=activation, swiglu_limit=limit)
        want = fused_experts_torch(hidden, topk_weights=topk_w, topk_ids=topk_ids, **kw)
        assert torch.isfinite(want).all() and want.abs().sum() > 0
        tag = f"{shape_name} {'fp8' if fp8 else 'bf16'} M={m} {activation}"
        yield ReferenceCase(tag, hidden, topk_w, topk_ids, kw, want, tolerance(fp8))


def refill_and_replay(
    graph: torch.cuda.CUDAGraph,
    captured: tuple[torch.Tensor, ...],
    fresh: tuple[torch.Tensor, ...],
    out: torch.Tensor,
) -> None:
    """Copy ``fresh`` inputs into the tensors ``graph`` captured, poison its output ``out`` with
    NaN, replay it and wait for it."""
    for dst, src in zip(captured, fresh, strict=True):
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
