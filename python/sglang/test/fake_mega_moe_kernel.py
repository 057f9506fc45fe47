"""Torch stand-ins for the DeepGEMM pieces the MegaMoE weight prep and kernel use, so the whole
path (built weights, staged buffer, kernel) is checked for real on CPU.

- :func:`fake_transform_sf_into_required_layout`: fp32 power-of-two scales with one scale per row
  and per 32 K values -> UE8M0 bytes packed four to an int32 along K, stored MN-major (what the
  real function returns for ``recipe=(1, 32)`` on Blackwell).
- :func:`reference_mega_moe`: reads the kernel's inputs exactly as laid out (the FP8 rows and
  UE8M0 scales staged in the buffer, the transformed weights, undone with
  ``unbuild_mega_moe_experts_weights``) and computes
  ``y[t] = sum_k w[t,k] * W2[e] act(W13[e] x[t])`` in fp32 on this rank's experts.
  Unlike the real kernel it does not requantise the intermediate to FP8 (the test tolerances stay
  at the input's FP8 rounding), and it runs a one-rank group only (no dispatch to other ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sglang.srt.layers.activation import situ_torch, swiglu_torch
from sglang.srt.layers.moe.mega_moe_weights import (
    MXFP4_SF_RECIPE,
    SF_PER_INT32,
    MegaWeights,
    ue8m0_bytes,
    ue8m0_to_float,
    unbuild_mega_moe_experts_weights,
    unpack_ue8m0_words,
)
from sglang.srt.layers.quantization.mxfp4 import MXFP4_GROUP, dequant_mxfp4

Tensor = torch.Tensor


def fake_transform_sf_into_required_layout(
    sf: Tensor,
    mn: int,
    k: int,
    recipe: tuple[int, ...] | None = None,
    num_groups: int | None = None,
    disable_ue8m0_cast: bool = False,
    **_: Any,
) -> Tensor:
    if tuple(recipe or ())[-2:] != MXFP4_SF_RECIPE or disable_ue8m0_cast:
        raise NotImplementedError(
            f"the fake lays out UE8M0 (1, 32) scales only, got recipe {recipe}"
        )
    squeeze = sf.dim() == 2
    groups = sf.unsqueeze(0) if squeeze else sf
    want = (num_groups or 1, mn, k // MXFP4_GROUP)
    if tuple(groups.shape) != want or k % (MXFP4_GROUP * SF_PER_INT32):
        raise ValueError(
            f"scale shape {tuple(sf.shape)} does not fit mn={mn}, k={k}, groups={num_groups}"
        )
    words = ue8m0_bytes(groups.float(), "sf").contiguous().view(torch.int32)  # [G, MN, K/128]
    # MN-major: the MN dim has stride 1, as TMA loads of the scale rows want.
    out = torch.empty(words.shape[0], words.shape[2], mn, dtype=torch.int32).transpose(1, 2)
    out.copy_(words)
    return out[0] if squeeze else out


def _activation(h: Tensor, activation: str, clamp: float | None) -> Tensor:
    if activation == "swiglu":
        return swiglu_torch(h, clamp)
    if activation == "situ":
        if clamp is not None:
            raise ValueError("DeepGEMM takes no activation_clamp with situ")
        return situ_torch(h)
    raise ValueError(f"unknown MegaMoE activation {activation!r}")


def _staged_rows(buf: Any, rows: int) -> Tensor:
    """The FP8 rows the pre-dispatch staged, with their per-32 UE8M0 scales, in fp32."""
    scale_bytes = unpack_ue8m0_words(buf.x_sf[:rows])
    scales = ue8m0_to_float(scale_bytes).repeat_interleave(MXFP4_GROUP, dim=-1)
    return buf.x[:rows].float() * scales


def _routed_sum(
    x: Tensor, buf: Any, w13: Tensor, w2: Tensor, act: Callable[[Tensor], Tensor], rows: int
) -> Tensor:
    """fp32 ``[rows, H]``: each of the first ``rows`` tokens of ``buf``'s routing through its
    experts, ``act(x @ w13^T)`` times the top-k weight (on the intermediate before L2, as in the
    kernel) then ``@ w2^T``, summed per token."""
    ids, weights = buf.topk_idx[:rows], buf.topk_weights[:rows].float()
    out = torch.zeros(rows, w2.shape[1])
    for e in range(w13.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        inner = act(x[token] @ w13[e].T)
        out.index_add_(0, token, (inner * weights[token, slot, None]) @ w2[e].T)
    return out


def reference_mega_moe(
    y: Tensor,
    l1: tuple[Tensor, Tensor],
    l2: tuple[Tensor, Tensor],
    buf: Any,
    *,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
) -> None:
    mega: MegaWeights = (l1, l2)
    experts = unbuild_mega_moe_experts_weights(mega)
    if experts.fmt != "mxfp4":
        raise NotImplementedError("the fake fp8_fp4_mega_moe takes MXFP4 weights only")
    w13 = dequant_mxfp4(experts.w13, experts.w13_scale, torch.float32)
    w2 = dequant_mxfp4(experts.w2, experts.w2_scale, torch.float32)
    num_experts = getattr(buf, "num_experts", None)
    if num_experts is not None and num_experts != w13.shape[0]:
        raise NotImplementedError(
            f"the fake kernel runs a one-rank group: {w13.shape[0]} local of {num_experts} experts"
        )
    rows = y.shape[0]
    x = _staged_rows(buf, rows)
    out = _routed_sum(x, buf, w13, w2, lambda h: _activation(h, activation, activation_clamp), rows)
    y.copy_(out.to(y.dtype))


def reference_sm90_mega_moe(
    y: Tensor,
    l1: tuple[Tensor, Tensor],
    l2: tuple[Tensor, Tensor],
    buf: Any,
    *,
    activation_clamp: float | None = None,
) -> None:
    """The SM90 ``fp8_mega_moe`` on a one-rank group, in fp32: the staged FP8 rows with their
    fp32 per-128 scales, FP8 128x128 block weights (gate/up rows interleaved by 8), clamped
    SwiGLU, top-k weights on the intermediate, summed per token."""
    experts = unbuild_mega_moe_experts_weights((l1, l2))
    if experts.fmt != "fp8":
        raise NotImplementedError("the fake fp8_mega_moe takes FP8 weights only")

    def dequant(q: Tensor, s: Tensor) -> Tensor:
        full = s.float().repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
        return q.float() * full[:, : q.shape[1], : q.shape[2]]

    w13, w2 = dequant(experts.w13, experts.w13_scale), dequant(experts.w2, experts.w2_scale)
    rows = y.shape[0]
    x = buf.x[:rows].float() * buf.x_sf[:rows].float().repeat_interleave(128, dim=-1)
    out = _routed_sum(x, buf, w13, w2, lambda h: swiglu_torch(h, activation_clamp), rows)
    y.copy_(out.to(y.dtype))
