"""mHC for DeepSeek V4 as the model calls it: which kernel backend a call takes, and where the
layer input lives. The maths and the kernels are ``kernels/ops/layernorm/mhc.py``, which run the
backend and write into the ``out`` that this module hands them.

Backend (``_backend``): CPU tensors take torch. CUDA tensors take, by ``SGLANG_MHC_BACKEND``
(default ``auto``), Triton, else TileLang (``mhc_tilelang.py``) when ``tilelang`` imports, else
torch. ``auto`` prefers Triton because it measured faster than TileLang at every token count up
to 512 on an H200 (``scripts/bench_mhc.py``; the table is in docs/performance.md); TileLang is
faster only on 4096-token prefill chunks, so it is an explicit choice. An explicit
``tilelang`` / ``triton`` that cannot be honoured raises instead of silently running something
else. The choice and its reason are logged once. TileLang covers pre and fused post+pre (the
per-sublayer kernels); a lone post (once per forward) runs on Triton.

Symmetric memory: ``layer_input`` feeds the MoE, whose in-place runner then hands the same storage
to the TP all-reduce, so it (and only it: not post, comb or the residual) is allocated inside
:func:`~sglang.srt.layers.dp_attention.symmetric_output_scope`. The kernels make their
intermediates outside that scope because the pool never shrinks.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from sglang.kernels.fit.decide import limits_for
from sglang.kernels.fit.switch import families_off_count
from sglang.kernels.ops.layernorm import mhc as mhc_kernels
from sglang.kernels.ops.layernorm import mhc_tilelang, mhc_triton
from sglang.kernels.ops.layernorm.mhc import Backend, hc_post_torch_impl, mhc_head
from sglang.kernels.ops.layernorm.mhc_params import MhcParams
from sglang.srt.distributed.symm_mem.output_scope import symmetric_output_scope
from sglang.srt.environ import envs
from sglang.srt.utils.log import get_logger, log_once

# The torch post and the head allocate nothing shared and choose no backend: the model takes them
# from here with the rest of mHC.
__all__ = [
    "MhcParams",
    "hc_post_torch_impl",
    "mhc_fused_post_pre",
    "mhc_head",
    "mhc_post",
    "mhc_pre",
    "mhc_pre_torch",
    "reset_backend_selection",
    "select_backend",
]

_ENV = "SGLANG_MHC_BACKEND"
_HAS_TRITON = mhc_triton.HAS_TRITON  # a global of this module, so tests can pretend either way

logger = get_logger(__name__)


def _alloc_layer_input(residual: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """The only allocation made in the symmetric pool: the ``[T, H]`` layer input."""
    t, h = mhc_kernels.layer_input_shape(residual, fn)
    with symmetric_output_scope():
        return torch.empty(t, h, dtype=residual.dtype, device=residual.device)


# ----------------------------------------------------------------------------- backend choice


@functools.lru_cache(maxsize=1)
def _tilelang_import_error() -> str | None:
    """None when ``tilelang`` imports, else why not. Tried once, on the first CUDA call: the import
    takes seconds and CPU-only processes never need it."""
    try:
        import tilelang  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError
        return f"{type(exc).__name__}: {exc}"
    return None


def _tilelang_version() -> str:
    import tilelang

    return str(getattr(tilelang, "__version__", "unknown"))


def select_backend(residual: torch.Tensor) -> tuple[Backend, str]:
    """(backend, why) for a call on ``residual``. Reads ``SGLANG_MHC_BACKEND`` on every call, so a
    test or launcher can change it; raises when an explicit kernel backend does not import, and
    passes over a backend whose kernels do not fit the device or failed to build (torch runs).
    Uncached (the exact reason for this residual); the per-call path goes through ``_backend``."""
    requested = envs.SGLANG_MHC_BACKEND.get()
    if not residual.is_cuda:
        return "torch", f"tensors on {residual.device.type}: the kernels are CUDA-only"
    # tilelang_supports (hc = 4, a kernel dtype) also covers what the Triton kernels need.
    if not mhc_tilelang.tilelang_supports(residual):
        return "torch", (
            f"residual {tuple(residual.shape)} {residual.dtype}: the kernels are written for hc=4"
        )
    if requested == "torch":
        return "torch", f"{_ENV}=torch"
    limits = limits_for(residual)
    # Kernels chosen by fit: a backend whose kernels do not fit this device (or that failed to
    # build, sglang.kernels.fit.switch) is passed over with its reason, never raised.
    triton_unfit = (
        mhc_triton.mhc_triton_unfit_reason(residual.dtype, residual.shape[1], limits)
        if _HAS_TRITON
        else None
    )
    if requested == "auto" and _HAS_TRITON and triton_unfit is None:
        return "triton", f"{_ENV}=auto: Triton, measured faster than TileLang up to 512 tokens"
    if requested == "triton" and triton_unfit is not None:
        return "torch", f"{_ENV}=triton, but its kernels cannot run here: {triton_unfit}"
    if requested in ("auto", "tilelang"):
        error = _tilelang_import_error()
        unfit = mhc_tilelang.mhc_tilelang_unfit_reason(residual, limits) if error is None else None
        if unfit is not None:
            return "torch", f"{_ENV}={requested}: TileLang cannot run here ({unfit})" + (
                f"; Triton: {triton_unfit}" if triton_unfit else ""
            )
        if error is None:
            why = ","
            if requested == "auto":
                why = f", Triton cannot run here ({triton_unfit})," if triton_unfit else ""
                why = why or ", triton does not import,"
            return "tilelang", f"{_ENV}={requested}{why} tilelang {_tilelang_version()} imports"
        if requested == "tilelang":
            raise RuntimeError(f"{_ENV}=tilelang but tilelang does not import ({error})")
        if triton_unfit is not None:
            return (
                "torch",
                f"{_ENV}=auto: Triton cannot run here ({triton_unfit}), tilelang does not import",
            )
        return "torch", f"{_ENV}=auto, neither triton nor tilelang ({error}) imports"
    if not _HAS_TRITON:
        raise RuntimeError(f"{_ENV}=triton but triton does not import")
    return "triton", f"{_ENV}=triton"


# What select_backend's answer depends on, besides the tilelang import (cached on its own):
# (raw SGLANG_MHC_BACKEND or None, device type, kernels cover the shape/dtype, triton imports,
# residual dtype, kernel families turned off so far).
_DecisionKey = tuple[str | None, str, bool, bool, torch.dtype, int]
_decisions: dict[_DecisionKey, Backend] = {}


def reset_backend_selection() -> None:
    """Forget every backend decision and the tilelang import result (tests that change the
    environment, ``sys.modules['tilelang']`` or ``_HAS_TRITON`` between calls)."""
    _decisions.clear()
    _tilelang_import_error.cache_clear()


def _backend(residual: torch.Tensor) -> Backend:
    # Three calls per layer per forward: after the first call of a key, only the key is built
    # (no env validation, tilelang probe, reason formatting or log_once lock). The raw env value
    # is the key, so a bad value is parsed (and raises) by select_backend on every call, uncached.
    key = (
        os.environ.get(_ENV),
        residual.device.type,
        mhc_tilelang.tilelang_supports(residual),
        _HAS_TRITON,
        residual.dtype,
        families_off_count(),
    )
    backend = _decisions.get(key)
    if backend is None:
        backend, why = select_backend(residual)
        log_once(logger, logging.INFO, f"mHC kernels: {backend} ({why})")
        _decisions[key] = backend
    return backend


# ----------------------------------------------------------------------------- entry points


def mhc_pre(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    params: MhcParams,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre (+ the sublayer's RMSNorm when ``params`` has one) on the chosen backend
    -> (layer_input [T,H] residual dtype, symmetric when allowed; post [T,hc] fp32;
    comb [T,hc,hc] fp32)."""
    return mhc_kernels.mhc_pre(
        residual,
        fn,
        scale,
        base,
        params,
        backend=_backend(residual),
        out=_alloc_layer_input(residual, fn),
    )


def mhc_pre_torch(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    params: MhcParams,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch pre (its norm left out) on any device, its layer input allocated like
    :func:`mhc_pre`'s."""
    return mhc_kernels.mhc_pre_torch(
        residual, fn, scale, base, params, out=_alloc_layer_input(residual, fn)
    )


def mhc_post(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """mHC post -> the new residual [T, hc, H] (ordinary allocation). A TileLang choice runs it on
    Triton: it runs once per forward (the other posts are fused into the next pre)."""
    use_triton = _backend(residual) != "torch" and _HAS_TRITON
    return mhc_kernels.mhc_post(
        x, residual, post, comb, backend="triton" if use_triton else "torch"
    )


def mhc_fused_post_pre(
    x: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    params: MhcParams,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sublayer's post fused with the next one's pre (+ norm) on the chosen backend:
    -> (new_residual, layer_input, post_next, comb_next); equal to mhc_post then mhc_pre."""
    return mhc_kernels.mhc_fused_post_pre(
        x,
        residual,
        post,
        comb,
        fn,
        scale,
        base,
        params,
        backend=_backend(residual),
        out=_alloc_layer_input(residual, fn),
    )
