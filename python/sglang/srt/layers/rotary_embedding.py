"""Interleaved (GPT-J style) rotary embedding on the tail of each head, with optional YaRN.

DeepSeek V4 rotates only the last ``rope_dim`` channels of a head (``[nope | rope]`` layout) and
pairs channels ``(2i, 2i+1)`` as complex numbers. Frequencies: ``theta^(-2i/rope_dim)``; with YaRN
the low frequencies are interpolated by ``factor`` and a linear ramp between the ``beta_fast`` /
``beta_slow`` correction dims blends the two. V4 does not scale the softmax by YaRN's mscale, so
``attention_factor`` defaults to 1 (cos/sin are multiplied by it).

cos/sin are computed from the positions on every call (``pos * inv_freq`` in fp32): no table up
to ``max_position_embeddings`` (1M for V4) is kept. The rotation itself is
:func:`apply_interleaved_rope` (torch maths, in ``kernels/ops/attention/rope.py``); DeepSeek V4's
attention runs it fused with its norms (``kernels/ops/attention/norm_rope.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

# The maths lives with the kernels (their torch references use it too); layers import it from here.
from sglang.kernels.ops.attention.rope import apply_interleaved_rope, rope_cos_sin_torch
from sglang.kernels.ops.attention.rope_cos_sin import rope_cos_sin, rope_cos_sin_unfit_reason
from sglang.kernels.ops.triton_dispatch import triton_can_run

__all__ = [
    "InterleavedRotaryEmbedding",
    "RopeSpec",
    "YarnScaling",
    "apply_interleaved_rope",
    "rope_inv_freq",
]


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    # Round the correction range outward to whole dims (the DeepSeek / transformers default).
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"YaRN factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "YaRN original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )


@dataclass(frozen=True)
class RopeSpec:
    rope_dim: int
    theta: float
    yarn: YarnScaling | None = None

    def __post_init__(self) -> None:
        if self.rope_dim <= 0 or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be a positive even number, got {self.rope_dim}")

    @property
    def attention_factor(self) -> float:
        return 1.0 if self.yarn is None else self.yarn.attention_factor


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    """The (fractional) dim index whose wavelength fits ``num_rotations`` times in ``max_pos``."""
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq(spec: RopeSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """``[rope_dim / 2]`` fp32 inverse frequencies."""
    dim, base = spec.rope_dim, spec.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    pos_freqs = base**exponents
    inv_extra = 1.0 / pos_freqs
    yarn = spec.yarn
    if yarn is None:
        return inv_extra
    inv_inter = 1.0 / (yarn.factor * pos_freqs)
    low = _yarn_correction_dim(yarn.beta_fast, dim, base, yarn.original_max_position_embeddings)
    high = _yarn_correction_dim(yarn.beta_slow, dim, base, yarn.original_max_position_embeddings)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = (
        (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
    ).clamp(0, 1)
    # ramp 0 -> keep the original (extrapolated) frequency, ramp 1 -> the interpolated one
    return inv_inter * ramp + inv_extra * (1 - ramp)


class InterleavedRotaryEmbedding(nn.Module):
    """cos/sin for a :class:`RopeSpec`; apply with :func:`apply_interleaved_rope`."""

    inv_freq: torch.Tensor

    def __init__(self, spec: RopeSpec, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.register_buffer("inv_freq", rope_inv_freq(spec, device), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [...]`` -> fp32 ``(cos, sin)`` of shape ``[..., rope_dim / 2]``: one Triton
        launch where it can run, else the torch maths (six launches)."""
        inv_freq = self.inv_freq.to(positions.device)
        f = self.spec.attention_factor
        if triton_can_run(positions) and rope_cos_sin_unfit_reason(positions, inv_freq) is None:
            return rope_cos_sin(positions, inv_freq, f)
        return rope_cos_sin_torch(positions, inv_freq, f)
