"""Activation quantisation fused into its producer: the FP8 GEMM input written by the op that
makes it, so the next block-FP8 GEMM needs no quantiser launch and the bf16 intermediate need not
make a round trip through HBM.

- :func:`rms_norm_quant_fp8`: RMSNorm (fp32 weight) of ``x [M, N]``, or of the sum of a split-K
  GEMM's fp32 partials ``[S, M, N]`` (the GEMM's reduction fused in), then e4m3 with one scale per
  128 values of a row. DeepSeek V4's ``wq_a -> q_norm -> wq_b`` (and the indexer's ``wq_b``, which
  reads the same normed rows).
- :func:`gated_act_quant_fp8`: the gated activation (SwiGLU with its clamp, or SiTU) of separate
  ``gate`` / ``up`` tensors, then e4m3: the shared expert's ``w1``, ``w3 -> w2``.

Both round where the unfused path rounds (the GEMM output, then the normed / activated row, to the
model dtype) before quantising, so they equal ``per_token_group_quant_fp8`` of the unfused result
(up to the order of the fp32 sum of squares). Scales are fp32, MN-major (DeepGEMM's layout). The
torch versions are the references (and the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.ops.activation import act_and_mul_reference, activation_code, gated_act
from sglang.kernels.ops.layernorm.rms_norm import rms_norm
from sglang.kernels.ops.quant.dtype_round import ROUND_CODES, round_to
from sglang.kernels.ops.quant.fp8 import (
    DEFAULT_EPS,
    FP8_DTYPE,
    empty_group_scales,
    per_token_group_quant_fp8,
    quant_rows_fp8,
)
from sglang.kernels.ops.triton_dispatch import triton_can_run

GROUP = 128  # values per activation scale (the block-FP8 GEMMs' K block)
_MAX_ROW = 16384  # the norm holds a whole row in registers


@triton.jit
def _store_groups(q_ptr, s_ptr, row, y, n, eps, stride_qm, stride_sm, stride_sk,
                  BLOCK_G: tl.constexpr, GROUP_SIZE: tl.constexpr):  # fmt: skip
    """Quantise ``y [BLOCK_G * GROUP_SIZE]`` (zero past ``n``) per group and store q and the
    group scales of row ``row``."""
    q, scale = quant_rows_fp8(tl.reshape(y, (BLOCK_G, GROUP_SIZE)), eps)
    cols = tl.arange(0, BLOCK_G * GROUP_SIZE)
    groups = tl.arange(0, BLOCK_G)
    q_flat = tl.reshape(q, (BLOCK_G * GROUP_SIZE,))
    tl.store(q_ptr + row * stride_qm + cols, q_flat.to(q_ptr.dtype.element_ty), mask=cols < n)
    g_ok = groups * GROUP_SIZE < n
    tl.store(s_ptr + row * stride_sm + groups * stride_sk, scale, mask=g_ok)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr,
    w_ptr,
    normed_ptr,
    q_ptr,
    s_ptr,
    n,
    splits,
    stride_xs,
    stride_xm,
    stride_nm,
    stride_qm,
    stride_sm,
    stride_sk,
    eps,
    quant_eps,
    IN_ROUND: tl.constexpr,
    OUT_ROUND: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_G * GROUP_SIZE)
    ok = cols < n
    ptrs = x_ptr + row * stride_xm + cols
    x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    for s in range(1, splits):  # split-K partials, added in split order
        x += tl.load(ptrs + s * stride_xs, mask=ok, other=0.0)
    x = round_to(x, IN_ROUND)  # the GEMM output as the unfused path stores it
    r = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = round_to(x * r * w, OUT_ROUND)
    if WRITE_NORMED:
        tl.store(normed_ptr + row * stride_nm + cols, y.to(normed_ptr.dtype.element_ty), mask=ok)
    _store_groups(q_ptr, s_ptr, row, y, n, quant_eps, stride_qm, stride_sm, stride_sk,
                  BLOCK_G, GROUP_SIZE)  # fmt: skip


@triton.jit
def _gated_act_quant_kernel(
    gate_ptr,
    up_ptr,
    q_ptr,
    s_ptr,
    n,
    stride_gm,
    stride_um,
    stride_qm,
    stride_sm,
    stride_sk,
    limit,
    quant_eps,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    OUT_ROUND: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK_G * GROUP_SIZE
    cols = first + tl.arange(0, BLOCK_G * GROUP_SIZE)
    ok = cols < n
    gate = tl.load(gate_ptr + row * stride_gm + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_um + cols, mask=ok, other=0.0).to(tl.float32)
    y = round_to(gated_act(gate, up, limit, ACTIVATION, HAS_LIMIT), OUT_ROUND)
    y = tl.where(ok, y, 0.0)
    _store_groups(q_ptr + first, s_ptr + tl.program_id(1) * BLOCK_G * stride_sk, row, y,
                  n - first, quant_eps, stride_qm, stride_sm, stride_sk, BLOCK_G,
                  GROUP_SIZE)  # fmt: skip


def _quant_outputs(rows: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty((rows, n), dtype=FP8_DTYPE, device=device)
    return q, empty_group_scales(rows, triton.cdiv(n, GROUP), device, mn_major=True)


def _quant_torch(y: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_group_quant_fp8`` (torch) of ``y``, zero-padded to whole groups; q cut back
    to ``y``'s width, scales MN-major."""
    n = y.shape[-1]
    padded = torch.nn.functional.pad(y, (0, -n % GROUP))
    q, s = per_token_group_quant_fp8(padded, GROUP, eps, use_triton=False, scale_mn_major=True)
    return q[..., :n].contiguous(), s


def rms_norm_quant_fp8_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    round_dtype: torch.dtype = torch.bfloat16,
    quant_eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: ``(normed, q, scale)``; ``x`` ``[M, N]`` or fp32 partials ``[S, M, N]``."""
    if x.dim() == 3:
        x = x.float().sum(0).to(round_dtype)
    normed = rms_norm(x.float(), weight, eps).to(round_dtype)
    q, s = _quant_torch(normed.float(), quant_eps)
    return normed, q, s


def rms_norm_quant_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    round_dtype: torch.dtype = torch.bfloat16,
    normed_out: torch.Tensor | None = None,
    quant_eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm then FP8: ``x [M, N]`` (bf16/fp16/fp32), or a split-K GEMM's fp32 partials
    ``[S, M, N]`` summed first, rounded to ``round_dtype`` (what the unfused GEMM stores), normed
    with ``weight [N]`` (fp32 product, rounded to ``round_dtype``), quantised per 128 values.
    Returns ``(q [M, N] e4m3, scale [M, ceil(N/128)] fp32 MN-major)``; with ``normed_out``
    (``[M, N]``) the normed rows are written there too. A Triton kernel on CUDA (and under the
    interpreter), the torch reference elsewhere."""
    partials = x if x.dim() == 3 else x.unsqueeze(0)
    splits, rows, n = partials.shape
    if weight.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit rows of {n}")
    if n > _MAX_ROW:
        raise ValueError(f"rows of {n} exceed the fused norm's {_MAX_ROW}")
    if x.dim() == 3 and x.dtype != torch.float32:
        raise ValueError(f"split-K partials must be float32, got {x.dtype}")
    if round_dtype not in ROUND_CODES:
        raise ValueError(f"round_dtype must be one of {tuple(ROUND_CODES)}, got {round_dtype}")
    if not triton_can_run(x) or unfit_reason("fp8_rows") is not None:
        normed, q, s = rms_norm_quant_fp8_torch(
            x, weight, eps, round_dtype=round_dtype, quant_eps=quant_eps
        )
        if normed_out is not None:
            normed_out.copy_(normed)
        return q, s
    if partials.stride(-1) != 1:
        partials = partials.contiguous()
    q, s = _quant_outputs(rows, n, x.device)
    write = normed_out is not None
    normed = normed_out if normed_out is not None else q
    if rows:
        _rms_norm_quant_kernel[(rows,)](
            partials,
            weight,
            normed,
            q,
            s,
            n,
            splits,
            partials.stride(0),
            partials.stride(1),
            normed.stride(0),
            q.stride(0),
            s.stride(0),
            s.stride(1),
            eps,
            quant_eps,
            IN_ROUND=ROUND_CODES[round_dtype] if x.dim() == 3 else 0,
            OUT_ROUND=ROUND_CODES[round_dtype],
            WRITE_NORMED=write,
            BLOCK_G=triton.next_power_of_2(triton.cdiv(n, GROUP)),
            GROUP_SIZE=GROUP,
            num_warps=4 if n <= 4096 else 8,
        )
    return q, s


def gated_act_quant_fp8_torch(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    swiglu_limit: float | None = None,
    *,
    quant_eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the unfused ``act_and_mul`` (rounded to the inputs' dtype), then quantised."""
    act = act_and_mul_reference(torch.cat([gate, up], dim=-1), activation, swiglu_limit)
    return _quant_torch(act.float(), quant_eps)


def gated_act_quant_fp8(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    swiglu_limit: float | None = None,
    *,
    quant_eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``activation(gate, up)`` (``[M, I]`` each, same dtype), rounded to that dtype, then FP8:
    ``(q [M, I] e4m3, scale [M, ceil(I/128)] fp32 MN-major)``."""
    code = activation_code(activation, swiglu_limit)
    if gate.shape != up.shape or gate.dim() != 2 or gate.dtype != up.dtype:
        raise ValueError(
            f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must be "
            "two [M, I] tensors of one dtype"
        )
    if gate.dtype not in ROUND_CODES:
        raise ValueError(f"gate/up must be bf16, fp16 or fp32, got {gate.dtype}")
    if not triton_can_run(gate) or unfit_reason("fp8_rows") is not None:
        return gated_act_quant_fp8_torch(gate, up, activation, swiglu_limit, quant_eps=quant_eps)
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    rows, n = gate.shape
    q, s = _quant_outputs(rows, n, gate.device)
    if rows and n:
        per_prog = min(triton.next_power_of_2(triton.cdiv(n, GROUP)), 8)  # 1024 values a program
        _gated_act_quant_kernel[(rows, triton.cdiv(n, per_prog * GROUP))](
            gate,
            up,
            q,
            s,
            n,
            gate.stride(0),
            up.stride(0),
            q.stride(0),
            s.stride(0),
            s.stride(1),
            float(swiglu_limit or 0.0),
            quant_eps,
            ACTIVATION=code,
            HAS_LIMIT=swiglu_limit is not None,
            OUT_ROUND=ROUND_CODES[gate.dtype],
            BLOCK_G=per_prog,
            GROUP_SIZE=GROUP,
            num_warps=4,
        )
    return q, s
