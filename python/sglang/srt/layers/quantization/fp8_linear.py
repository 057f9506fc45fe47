"""The W8A8 product of a block-FP8 dense layer: activations quantised per token per 128 values,
then one FP8 GEMM, by the backend that fits the shape.

Backends (chosen per GEMM shape; the choice and its reason are logged once per shape):
- ``deep_gemm``: DeepGEMM's ``fp8_gemm_nt`` (SM90 1D2D kernel) where the adapter finds DeepGEMM
  usable and the shape fits it: bf16 output, K a multiple of 128, N a multiple of 64. Its
  activation scales are handed over MN-major and 16-byte aligned, the layout it reads, so it
  copies nothing;
- ``triton``: our block-FP8 GEMM (``kernels/ops/gemm``) for every other CUDA shape (fp16 output,
  ragged N or K), and for the grouped ``wo_a`` product;
- ``torch``: the reference maths (dequantise both operands, one fp32 product) off CUDA, so the CPU
  runs what the GPU computes.
``SGLANG_FP8_DENSE_GEMM`` forces ``triton`` or ``deep_gemm`` (where it cannot run, Triton runs and
one line says why). Nothing here synchronises with the host: CUDA-graph safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.ops.gemm.fp8_block_gemm import (
    fp8_block_gemm,
    fp8_block_gemm_torch,
    fp8_gemm_quant_out,
    fp8_grouped_gemm,
    fp8_grouped_gemm_torch,
    quant_activation_fp8,
)
from sglang.kernels.ops.gemm.fp8_gemm_config import FP8_SCALE_BLOCK
from sglang.kernels.ops.quant.fused_quant import gated_act_quant_fp8, rms_norm_quant_fp8
from sglang.srt.environ import envs
from sglang.srt.layers.deep_gemm_adapter import (
    deep_gemm_call_guard,
    deep_gemm_status,
    has_entry_point,
    resolve_entry_point,
)
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)

Fp8GemmBackend = Literal["deep_gemm", "triton", "torch"]
# DeepGEMM's SM90 FP8 GEMM tiles N in multiples of 64 (conservatively: every DeepSeek V4 dense
# shape is one) and writes bf16 only.
DEEP_GEMM_N_ALIGN = 64


@dataclass(frozen=True)
class Fp8Activation:
    """A GEMM input already quantised: ``q`` e4m3 ``[M, Kq]`` (or ``[M, G, Kq]`` for a grouped
    layer; ``Kq`` is the layer's K, or K zero-padded to a multiple of 128) and ``scale`` fp32
    ``[M, ceil(K/128)]`` (``[M, G, ceil(K/128)]``), any strides (MN-major suits DeepGEMM).
    Quantise once and hand it to several layers that read the same input (``wq_a`` and ``wkv``;
    the shared expert's ``w1`` and ``w3``), or take it from a fused producer
    (``kernels/ops/quant/fused_quant.py``)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.q.shape[0])


def quantize_activation(x: torch.Tensor) -> Fp8Activation:
    """``x [..., K]`` -> per-token-group FP8 over its rows (leading dims flattened)."""
    q, s = quant_activation_fp8(x.reshape(-1, x.shape[-1]), use_triton=x.is_cuda)
    return Fp8Activation(q, s)


def _deep_gemm_unfit(n: int, k: int, out_dtype: torch.dtype) -> str | None:
    """Why DeepGEMM's ``fp8_gemm_nt`` cannot take ``[M, k] x [n, k]^T`` here (None: it can)."""
    status = deep_gemm_status()
    if not status.usable or status.module is None:
        return f"DeepGEMM unusable: {status.reason}"
    if not has_entry_point(status.module, "fp8_gemm"):
        return f"DeepGEMM {status.version} has no fp8_gemm_nt"
    if out_dtype != torch.bfloat16:
        return f"DeepGEMM writes bf16 only, the model runs {out_dtype}"
    if k % FP8_SCALE_BLOCK:
        return f"DeepGEMM needs K a multiple of {FP8_SCALE_BLOCK}, got {k}"
    if n % DEEP_GEMM_N_ALIGN:
        return f"DeepGEMM needs N a multiple of {DEEP_GEMM_N_ALIGN}, got {n}"
    return None


def gemm_backend(
    n: int, k: int, out_dtype: torch.dtype, device: torch.device
) -> tuple[Fp8GemmBackend, str]:
    """The backend for a ``[M, k] x [n, k]^T`` FP8 GEMM and why; logged once per shape."""
    backend: Fp8GemmBackend
    forced = envs.SGLANG_FP8_DENSE_GEMM.get()
    level = logging.INFO
    if device.type != "cuda":
        backend, why = "torch", "not on CUDA: the reference maths"
    elif forced == "triton":
        backend, why = "triton", "SGLANG_FP8_DENSE_GEMM=triton"
    else:
        unfit = _deep_gemm_unfit(n, k, out_dtype)
        if unfit is None:
            backend, why = "deep_gemm", "fits DeepGEMM's fp8_gemm_nt"
        else:
            backend, why = "triton", unfit
            if forced == "deep_gemm":
                level = logging.WARNING
    off = unfit_reason("fp8_block_gemm") if backend == "triton" else None
    if off is not None:  # our kernel failed to build: the torch GEMM instead
        backend, why, level = "torch", off, logging.WARNING
    log_once(logger, level, f"FP8 dense GEMM N={n} K={k}: {backend} ({why})")
    return backend, why


def _as_activation(x: torch.Tensor | Fp8Activation, k: int) -> Fp8Activation:
    if isinstance(x, Fp8Activation):
        if x.q.shape[-1] < k:
            raise ValueError(f"quantised input {tuple(x.q.shape)} does not fit K={k}")
        return x
    if x.shape[-1] != k:
        raise ValueError(f"input {tuple(x.shape)} does not fit K={k}")
    return quantize_activation(x)


def fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x [..., K]`` (or its :class:`Fp8Activation`, rows flattened) times the block-FP8
    ``weight [N, K]`` (fp32 block ``scale``) -> ``[..., N]`` in ``out_dtype``."""
    n, k = weight.shape
    lead = x.shape[:-1] if isinstance(x, torch.Tensor) else (x.rows,)
    a = _as_activation(x, k)
    backend, _ = gemm_backend(n, k, out_dtype, weight.device)
    if backend == "torch":
        y = fp8_block_gemm_torch(a.q, a.scale, weight, scale, out_dtype)
    elif backend == "deep_gemm":
        y = deep_gemm_fp8_gemm(deep_gemm_status().module, a, weight, scale, out_dtype)
    else:
        y = fp8_block_gemm(a.q, a.scale, weight, scale, out_dtype=out_dtype)
    return y.view(*lead, n)


def deep_gemm_fp8_gemm(
    module: Any, a: Fp8Activation, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``a`` times ``weight`` through ``module``'s ``fp8_gemm_nt`` (SM90: A and B K-major, fp32
    scales, A's MN-major), into a fresh ``[M, N]``."""
    y = torch.empty((a.rows, weight.shape[0]), dtype=out_dtype, device=weight.device)
    if a.rows:
        with deep_gemm_call_guard():
            resolve_entry_point(module, "fp8_gemm")((a.q, a.scale), (weight, scale), y)
    return y


def fp8_grouped_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Block-diagonal: ``x [M, G, K]`` (or its :class:`Fp8Activation` ``[M, G, Kp]``) times
    ``weight [G * R, K]`` -> ``[M, G * R]``: group ``g`` times rows ``g*R .. g*R+R-1``. One
    Triton launch over all groups on CUDA, the torch reference elsewhere."""
    if isinstance(x, torch.Tensor):
        m, groups, k = x.shape
        a = quantize_activation(x.reshape(m * groups, k))
        a = Fp8Activation(a.q.view(m, groups, -1), a.scale.view(m, groups, -1))
    else:
        a = x
    if weight.device.type != "cuda":
        log_once(logger, logging.INFO, "FP8 grouped GEMM: torch (not on CUDA: the reference maths)")
        return fp8_grouped_gemm_torch(a.q, a.scale, weight, scale, out_dtype)
    off = unfit_reason("fp8_block_gemm")
    if off is not None:
        log_once(logger, logging.WARNING, f"FP8 grouped GEMM: torch ({off})")
        return fp8_grouped_gemm_torch(a.q, a.scale, weight, scale, out_dtype)
    log_once(logger, logging.INFO, "FP8 grouped GEMM: Triton (one launch over the groups)")
    return fp8_grouped_gemm(a.q, a.scale, weight, scale, out_dtype=out_dtype)


def fp8_grouped_linear_quantized(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    round_dtype: torch.dtype,
) -> Fp8Activation:
    """:func:`fp8_grouped_linear` whose output is quantised for the next FP8 GEMM: on CUDA in
    the GEMM's epilogue (each 128-column tile is one activation group; R must be a multiple of
    128), elsewhere the reference (the output rounded to ``round_dtype``, then quantised)."""
    m, groups, k = x.shape
    a = quantize_activation(x.reshape(m * groups, k))
    a = Fp8Activation(a.q.view(m, groups, -1), a.scale.view(m, groups, -1))
    off = unfit_reason("fp8_block_gemm")
    if weight.device.type != "cuda" or off is not None:
        if off is not None:
            log_once(logger, logging.WARNING, f"FP8 grouped GEMM, quantised output: torch ({off})")
        return quantize_activation(fp8_grouped_gemm_torch(a.q, a.scale, weight, scale, round_dtype))
    log_once(logger, logging.INFO, "FP8 grouped GEMM: Triton, its epilogue quantising the output")
    q, s = fp8_gemm_quant_out(a.q, a.scale, weight, scale, round_dtype=round_dtype)
    return Fp8Activation(q, s)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Activation:
    """RMSNorm of ``x [T, N]`` (fp32 ``weight``), rounded to x's dtype, quantised per 128 values:
    one Triton launch on CUDA (``fused_quant.rms_norm_quant_fp8``), the reference elsewhere."""
    q, s = rms_norm_quant_fp8(x, weight, eps, round_dtype=x.dtype)
    return Fp8Activation(q, s)


def gated_act_quant(
    gate: torch.Tensor, up: torch.Tensor, activation: str, swiglu_limit: float | None
) -> Fp8Activation:
    """The gated activation of ``gate`` and ``up`` ``[T, I]``, rounded to their dtype and
    quantised per 128 values, in one launch on CUDA."""
    q, s = gated_act_quant_fp8(gate, up, activation, swiglu_limit)
    return Fp8Activation(q, s)
