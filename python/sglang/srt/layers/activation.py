"""Gated activations of the MLPs and experts, on a concatenated ``gate_up`` tensor.

``gate_up`` is [..., 2I] with the gate in the first half and up in the second (checkpoints stack
``[gate; up]`` on the output rows; nothing is interleaved). Every function returns [..., I].

* ``swiglu``: DeepSeek V4's SwiGLU with an optional clamp ``swiglu_limit`` L:
  ``silu(min(gate, L)) * clamp(up, -L, L)``.
* ``situ``: Kimi K3's SiTU:
  ``beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta)``,
  bounded by about ``beta * linear_beta`` so an FP8 intermediate needs no clamp.

Maths is fp32 and the result is cast back to the input dtype. CUDA tensors go to the Triton
kernel; the torch versions here are the CPU path and the reference.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from sglang.srt.utils.log import get_logger, log_path_once

logger = get_logger(__name__)

Activation = Literal["swiglu", "situ"]
ACTIVATIONS: tuple[str, ...] = get_args(Activation)

# Kimi K3's released constants (SGLang's MegaMoE path asserts exactly these).
SITU_BETA = 4.0
SITU_LINEAR_BETA = 25.0


def _split_gate_up(gate_up: Tensor) -> tuple[Tensor, Tensor]:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2 != 0:
        raise ValueError(
            f"gate_up must be [..., 2*I] with an even last dim, got shape {tuple(gate_up.shape)}"
        )
    if not gate_up.dtype.is_floating_point:
        raise ValueError(f"gate_up must be floating point, got {gate_up.dtype}")
    gate, up = gate_up.float().chunk(2, dim=-1)
    return gate, up


def swiglu_torch(gate_up: Tensor, limit: float | None = None) -> Tensor:
    """``silu(gate) * up``; with ``limit`` L the gate is capped above at L and up is clamped to
    [-L, L] first (only the gate's top side is clamped: silu is already bounded below)."""
    if limit is not None and not limit > 0:
        raise ValueError(f"swiglu limit must be > 0 or None, got {limit!r}")
    gate, up = _split_gate_up(gate_up)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return (F.silu(gate) * up).to(gate_up.dtype)


def situ_torch(
    gate_up: Tensor, beta: float = SITU_BETA, linear_beta: float | None = SITU_LINEAR_BETA
) -> Tensor:
    """Kimi K3 SiTU. ``linear_beta=None`` skips the soft-cap on up (the config allows null)."""
    if not beta > 0:
        raise ValueError(f"situ beta must be > 0, got {beta!r}")
    if linear_beta is not None and not linear_beta > 0:
        raise ValueError(f"situ linear_beta must be > 0 or None, got {linear_beta!r}")
    gate, up = _split_gate_up(gate_up)
    gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return (gate * up).to(gate_up.dtype)


def act_and_mul(
    gate_up: Tensor, activation: Activation, *, swiglu_limit: float | None = None
) -> Tensor:
    """Apply ``activation`` to ``gate_up`` [..., 2I] -> [..., I]; Triton on CUDA, torch elsewhere.

    SiTU uses Kimi K3's constants (beta 4, linear_beta 25)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    if swiglu_limit is not None and activation != "swiglu":
        raise ValueError(f"swiglu_limit applies only to 'swiglu', not to {activation!r}")
    if _use_triton(gate_up):
        # Imported here so that CPU-only processes never import triton.
        from sglang.kernels.ops.activation import act_and_mul_triton

        return act_and_mul_triton(gate_up, activation, swiglu_limit)
    if activation == "swiglu":
        return swiglu_torch(gate_up, swiglu_limit)
    return situ_torch(gate_up)


def _use_triton(gate_up: Tensor) -> bool:
    if not gate_up.is_cuda:
        return False
    from sglang.kernels.ops.activation import act_and_mul_unfit_reason

    why = act_and_mul_unfit_reason(gate_up)
    log_path_once(logger, "gated activation", why)
    return why is None
