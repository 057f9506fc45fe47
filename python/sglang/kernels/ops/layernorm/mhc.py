"""mHC (manifold-constrained hyper-connections) for DeepSeek V4: pre, post, fused post+pre, head.

Shapes: the residual is ``[T, hc, H]`` (hc = hc_mult streams), a sublayer works on ``[T, H]``.

* pre:  ``r = rsqrt(mean(R_flat^2) + rms_eps)`` over the whole hc*H row (no weight);
  ``mixes = (R_flat @ fn^T) * r`` laid out ``[pre(hc) | post(hc) | comb(hc*hc, row-major)]``;
  ``pre = sigmoid(m*s0 + b) + hc_eps``; ``post = 2*sigmoid(m*s1 + b)``;
  ``comb = softmax(m*s2 + b, -1) + hc_eps``, a column normalisation, then ``iters-1`` x
  (row, column) Sinkhorn steps, each ``x / (sum + hc_eps)``;
  ``layer_input = sum_k pre_k * R[:, k]``.
* post: ``R'[:, j] = post_j * x + sum_k comb[k, j] * R[:, k]`` (comb is applied transposed: row k is
  the *old* stream k), fp32 maths, one cast to the residual dtype.
* head: like pre with only the sigmoid weights (no post/comb, no Sinkhorn).

Backends: every entry point runs the ``backend`` it is given (``torch`` here, ``triton`` from
``mhc_triton.py``, ``tilelang`` from ``mhc_tilelang.py``; default torch) and chooses none itself:
the caller decides which one a call takes. The Triton and TileLang kernels are written for CUDA
tensors with hc = 4 (``mhc_tilelang.tilelang_supports``); torch takes any hc and device.
TileLang covers pre and fused post+pre (the per-sublayer kernels); a lone post (once per forward)
has only Triton and torch.

Memory: the layer input (the ``[T, H]`` output of pre and of fused post+pre) goes into ``out`` when
the caller passes one (its own allocation, e.g. from a pool that a collective reads) and is
allocated with the default allocator only when ``out`` is None. Everything else (post, comb, the
new residual, the workspaces) is always an ordinary allocation, made by the kernels.
"""

from __future__ import annotations

from typing import Literal

import torch

from sglang.kernels.ops.layernorm import mhc_tilelang, mhc_triton
from sglang.kernels.ops.layernorm.mhc_params import MhcParams

# The shared constants live in mhc_tilelang, which never imports this module (this one imports it).
from sglang.kernels.ops.layernorm.mhc_tilelang import POST_MULT
from sglang.kernels.ops.layernorm.rms_norm import rms_norm

Backend = Literal["tilelang", "triton", "torch"]
BACKENDS: tuple[Backend, ...] = ("tilelang", "triton", "torch")


def _n_mix(residual: torch.Tensor) -> int:
    hc = residual.shape[1] if residual.dim() == 3 else 0
    return (2 + hc) * hc


def _check_shapes(residual: torch.Tensor, fn: torch.Tensor, n_mix: int) -> tuple[int, int, int]:
    if residual.dim() != 3:
        raise ValueError(f"residual must be [T, hc, H], got {tuple(residual.shape)}")
    t, hc, h = residual.shape
    if fn.shape != (n_mix, hc * h):
        raise ValueError(f"fn must be [{n_mix}, {hc * h}], got {tuple(fn.shape)}")
    return t, hc, h


def layer_input_shape(residual: torch.Tensor, fn: torch.Tensor) -> tuple[int, int]:
    """``(T, H)`` of the layer input that pre / fused post+pre make from ``residual`` and ``fn``
    (raises on inconsistent shapes): what a caller allocates as ``out``."""
    t, _hc, h = _check_shapes(residual, fn, _n_mix(residual))
    return t, h


def _checked_backend(backend: str, residual: torch.Tensor) -> Backend:
    if backend not in BACKENDS:
        raise ValueError(f"mHC backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "torch" and not mhc_tilelang.tilelang_supports(residual):
        raise ValueError(
            f"the {backend} mHC kernels are written for a residual [T, 4, H] of a kernel dtype, "
            f"got {tuple(residual.shape)} {residual.dtype}"
        )
    return backend  # type: ignore[return-value]


def _layer_input(out: torch.Tensor | None, t: int, h: int, residual: torch.Tensor) -> torch.Tensor:
    """``out`` checked against the layer input it must hold, or a fresh ordinary one."""
    if out is None:
        return torch.empty(t, h, dtype=residual.dtype, device=residual.device)
    if (
        out.shape != (t, h)
        or out.dtype != residual.dtype
        or out.device != residual.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous [{t}, {h}] {residual.dtype} tensor on {residual.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    return out


# ----------------------------------------------------------------------------- torch reference


def _rms_mixes(residual: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """``(R_flat @ fn^T) * rsqrt(mean(R_flat^2) + eps)`` in fp32 -> [T, n_mix]."""
    xf = residual.reshape(residual.shape[0], residual.shape[1] * residual.shape[2]).float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + rms_eps)
    return (xf @ fn.float().t()) * r


def _sinkhorn(c: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    c = torch.softmax(c, dim=-1) + hc_eps
    c = c / (c.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + hc_eps)
        c = c / (c.sum(dim=-2, keepdim=True) + hc_eps)
    return c


def _split_mixes(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, hc_eps: float, iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = scale.float()
    base = base.float()
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = POST_MULT * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    c = mixes[:, 2 * hc :].reshape(-1, hc, hc) * scale[2] + base[2 * hc :].reshape(hc, hc)
    return pre, post, _sinkhorn(c, hc_eps, iters)


def _pre_torch(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    params: MhcParams,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, hc, h = _check_shapes(residual, fn, _n_mix(residual))
    out = _layer_input(out, t, h, residual)
    pre, post, comb = _split_mixes(
        _rms_mixes(residual, fn, params.rms_eps),
        scale,
        base,
        hc,
        params.hc_eps,
        params.sinkhorn_iters,
    )
    y = (pre.unsqueeze(-1) * residual.float()).sum(dim=1).to(residual.dtype)
    if params.norm_weight is not None and params.norm_eps is not None:
        # Same as the separate RMSNorm on the stored (rounded) layer input.
        y = rms_norm(y, params.norm_weight, params.norm_eps)
    out.copy_(y)
    return out, post, comb


def mhc_pre_torch(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    params: MhcParams,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch mHC pre, its norm left out (a separate step of the caller's):
    (layer_input [T,H] residual dtype, post [T,hc] fp32, comb [T,hc,hc] fp32)."""
    return _pre_torch(residual, fn, scale, base, params.without_norm(), out)


def hc_post_torch_impl(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Torch mHC post: ``R'[:, j] = post_j * x + sum_k comb[k, j] * R[:, k]`` -> [T, hc, H]."""
    t, hc, _h = residual.shape
    post = post.reshape(t, hc).float()
    comb = comb.reshape(t, hc, hc).float()
    mixed = torch.bmm(comb.transpose(1, 2), residual.float())
    return (post.unsqueeze(-1) * x.float().unsqueeze(1) + mixed).to(residual.dtype)


def hc_head_torch_impl(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    params: MhcParams,
) -> torch.Tensor:
    """Final stream collapse: ``sum_k (sigmoid(m_k*s + b_k) + hc_eps) * R[:, k]`` -> [T, H]
    (no Sinkhorn, no norm: ``params``' eps only)."""
    hc = residual.shape[1]
    _check_shapes(residual, fn, hc)
    mixes = _rms_mixes(residual, fn, params.rms_eps)
    w = torch.sigmoid(mixes * scale.float()[0] + base.float()) + params.hc_eps
    return (w.unsqueeze(-1) * residual.float()).sum(dim=1).to(residual.dtype)


# ----------------------------------------------------------------------------- entry points


def _mhc_pre_impl(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    params: MhcParams,
    *,
    backend: Backend = "torch",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre (+ norm) on ``backend``: the one body behind :func:`mhc_pre` and the torch branch
    of :func:`mhc_fused_post_pre` (the name upstream's comments give the pre kernel)."""
    if _checked_backend(backend, residual) == "torch":
        return _pre_torch(residual, fn, scale, base, params, out)
    t, _hc, h = _check_shapes(residual, fn, _n_mix(residual))
    out = _layer_input(out, t, h, residual)
    kernel = mhc_tilelang.mhc_pre_tilelang if backend == "tilelang" else mhc_triton.mhc_pre_triton
    post, comb = kernel(residual, fn, scale, base, out, params)
    return out, post, comb


def mhc_pre(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    params: MhcParams,
    *,
    backend: Backend = "torch",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre (+ the sublayer's RMSNorm when ``params`` has one) on ``backend``, the layer
    input written into ``out`` when given
    -> (layer_input [T,H] residual dtype, post [T,hc] fp32, comb [T,hc,hc] fp32)."""
    return _mhc_pre_impl(residual, fn, scale, base, params, backend=backend, out=out)


def mhc_post(
    x: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    backend: Literal["triton", "torch"] = "torch",
) -> torch.Tensor:
    """mHC post -> the new residual [T, hc, H] (ordinary allocation). No TileLang variant: it runs
    once per forward (the other posts are fused into the next pre)."""
    if backend == "tilelang":
        raise ValueError("the mHC post has no TileLang kernel: run it on 'triton' or 'torch'")
    if _checked_backend(backend, residual) == "triton":
        return mhc_triton.mhc_post_triton(x, residual, post, comb)
    return hc_post_torch_impl(x, residual, post, comb)


def mhc_fused_post_pre(
    x: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    params: MhcParams,
    *,
    backend: Backend = "torch",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sublayer's post fused with the next one's pre (+ norm) on ``backend``, the layer input
    written into ``out`` when given -> (new_residual, layer_input, post_next, comb_next); equal to
    mhc_post then mhc_pre."""
    if _checked_backend(backend, residual) != "torch":
        t, hc, h = _check_shapes(residual, fn, _n_mix(residual))
        out = _layer_input(out, t, h, residual)
        residual = residual.contiguous()
        new_residual = torch.empty_like(residual)  # an ordinary allocation, like every residual
        kernel = (
            mhc_tilelang.mhc_fused_post_pre_tilelang
            if backend == "tilelang"
            else mhc_triton.mhc_fused_post_pre_triton
        )
        post_next, comb_next = kernel(
            residual,
            x.contiguous(),
            post.reshape(t, hc).float().contiguous(),
            comb.reshape(t, hc, hc).float().contiguous(),
            new_residual,
            fn,
            scale,
            base,
            out,
            params,
        )
        return new_residual, out, post_next, comb_next
    new_residual = hc_post_torch_impl(x, residual, post, comb)
    y, post_next, comb_next = _mhc_pre_impl(new_residual, fn, scale, base, params, out=out)
    return new_residual, y, post_next, comb_next


def mhc_head(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    params: MhcParams,
) -> torch.Tensor:
    """Final hyper-connection head (no Sinkhorn) -> [T, H]. Torch on every device: it runs once per
    forward, and its output is no collective input, so it is an ordinary allocation."""
    return hc_head_torch_impl(residual, fn, scale, base, params)
