"""Interleaved (GPT-J style) rotary embedding on the tail of each head, with optional YaRN.

DeepSeek V4 rotates only the last ``rope_dim`` channels of a head (``[nope | rope]`` layout) and
pairs channels ``(2i, 2i+1)`` as complex numbers. Frequencies: ``theta^(-2i/rope_dim)``; with YaRN
the low frequencies are interpolated by ``factor`` and a linear ramp between the ``beta_fast`` /
``beta_slow`` correction dims blends the two. V4 does not scale the softmax by YaRN's mscale, so
``attention_factor`` defaults to 1 (cos/sin are multiplied by it).

cos/sin are computed from the positions on every call (``pos * inv_freq`` in fp32): no table up
to ``max_position_embeddings`` (1M for V4) is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


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
        """``positions [...]`` -> fp32 ``(cos, sin)`` of shape ``[..., rope_dim / 2]``."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        f = self.spec.attention_factor
        return freqs.cos() * f, freqs.sin() * f


def apply_interleaved_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of ``x`` pairwise; the rest pass through.

    ``x`` is ``[T, ..., D]`` and ``cos``/``sin`` ``[T, rope_dim / 2]`` (broadcast over the middle
    dims). ``inverse`` rotates by the negative angle (V4 undoes the rope on the attention output,
    since V = K carries it). Maths in fp32, result in x's dtype (a new tensor)."""
    half = cos.shape[-1]
    rope_dim = 2 * half
    if x.shape[-1] < rope_dim:
        raise ValueError(f"rope_dim {rope_dim} exceeds the head dim {x.shape[-1]}")
    if cos.shape[0] != x.shape[0]:
        raise ValueError(f"cos has {cos.shape[0]} rows for {x.shape[0]} tokens")
    view = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(view), sin.reshape(view)
    if inverse:
        s = -s
    pairs = x[..., -rope_dim:].float().unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    out = x.clone()
    out[..., -rope_dim:] = rotated.to(x.dtype)
    return out
