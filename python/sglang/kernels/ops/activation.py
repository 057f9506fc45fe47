"""Gated activations in Triton: device functions for GEMM epilogues and an elementwise kernel.

``gate_up`` is [..., 2I]: the first half of the last dim is the gate, the second half is up.
Maths is fp32; the result is cast to the input dtype.

* swiglu (DeepSeek V4): with a limit L, ``g = min(gate, L)`` and ``u = clamp(up, -L, L)``;
  ``out = silu(g) * u``.
* situ (Kimi K3, beta 4 and linear beta 25):
  ``out = 4*tanh(gate/4)*sigmoid(gate) * 25*tanh(up/25)``.

The fused-MoE kernel calls :func:`gated_act` on its gate and up accumulators, so the activation
code exists once for both the elementwise and the fused path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason

# Activation codes passed to kernels as constexpr (ints compile alike on every Triton version).
ACT_SWIGLU = 0
ACT_SITU = 1
_ACT_CODES: dict[str, int] = {"swiglu": ACT_SWIGLU, "situ": ACT_SITU}
# A jitted function may read only constexpr globals, so the code it compares against is wrapped.
_ACT_SITU = tl.constexpr(ACT_SITU)


def activation_code(activation: str, swiglu_limit: float | None) -> int:
    """Validate ``activation``/``swiglu_limit`` and return the kernel's constexpr code."""
    if activation not in _ACT_CODES:
        raise ValueError(f"unknown activation {activation!r}; expected one of {tuple(_ACT_CODES)}")
    if swiglu_limit is not None:
        if activation != "swiglu":
            raise ValueError(f"swiglu_limit applies only to 'swiglu', not to {activation!r}")
        if not swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be > 0 or None, got {swiglu_limit!r}")
    return _ACT_CODES[activation]


@triton.jit
def _tanh(x):
    # tanh through exp of a non-positive argument: never overflows, and needs no libdevice
    # (libdevice is unavailable in the interpreter and its path moved between Triton versions).
    # Near zero, 1 - e cancels; a short odd series is exact to fp32 there.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(x < 0, -t, t)
    x2 = x * x
    series = x * (1.0 - x2 * (1.0 / 3.0) + x2 * x2 * (2.0 / 15.0))
    return tl.where(tl.abs(x) < 0.0625, series, t)


@triton.jit
def swiglu_fn(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """silu(min(gate, L)) * clamp(up, -L, L) on fp32 tensors (no clamp without a limit)."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def situ_fn(gate, up):
    """Kimi K3 SiTU on fp32 tensors: 4*tanh(gate/4)*sigmoid(gate) * 25*tanh(up/25)."""
    g = 4.0 * _tanh(gate * 0.25) * tl.sigmoid(gate)
    u = 25.0 * _tanh(up * 0.04)
    return g * u


@triton.jit
def gated_act(gate, up, limit, ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """Dispatch on the constexpr activation code; ``gate``/``up`` are fp32."""
    if ACTIVATION == _ACT_SITU:
        out = situ_fn(gate, up)
    else:
        out = swiglu_fn(gate, up, limit, HAS_LIMIT)
    return out


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    stride_x_row,
    stride_out_row,
    limit,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * stride_x_row
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gated_act(gate, up, limit, ACTIVATION, HAS_LIMIT)
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul_unfit_reason(gate_up: torch.Tensor) -> str | None:
    """None when the elementwise kernel takes ``gate_up`` (a float dtype, the family on; a
    program is 1024 values in registers, no shared memory), else why the torch maths runs."""
    if gate_up.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"gate_up is {gate_up.dtype}, the kernel takes fp32, bf16 or fp16"
    return unfit_reason("activation")


def act_and_mul_triton(
    gate_up: torch.Tensor, activation: str, swiglu_limit: float | None = None
) -> torch.Tensor:
    """``gate_up`` [..., 2I] -> [..., I] with the gated ``activation`` ("swiglu" or "situ")."""
    code = activation_code(activation, swiglu_limit)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2*I], got shape {tuple(gate_up.shape)}")
    inter = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * inter)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        grid = (x.shape[0], triton.cdiv(inter, block))
        _act_and_mul_kernel[grid](
            x,
            out,
            inter,
            x.stride(0),
            out.stride(0),
            float(swiglu_limit or 0.0),
            ACTIVATION=code,
            HAS_LIMIT=swiglu_limit is not None,
            BLOCK=block,
            num_warps=4,
        )
    return out.view(*gate_up.shape[:-1], inter)


def act_and_mul_reference(
    gate_up: torch.Tensor, activation: str, swiglu_limit: float | None = None
) -> torch.Tensor:
    """Torch version of the same maths (fp32, cast back); the fused-MoE reference uses it."""
    activation_code(activation, swiglu_limit)
    gate, up = gate_up.float().chunk(2, dim=-1)
    if activation == "situ":
        out = 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * (25.0 * torch.tanh(up / 25.0))
    else:
        if swiglu_limit is not None:
            gate = gate.clamp(max=swiglu_limit)
            up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        out = torch.nn.functional.silu(gate) * up
    return out.to(gate_up.dtype)
