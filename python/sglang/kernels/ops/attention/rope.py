"""Interleaved (GPT-J style) RoPE maths in torch: the one definition that the layers'
rotary embedding and the kernels' torch references share (the Triton kernels are in
``rope_cos_sin.py`` and ``norm_rope.py``)."""

from __future__ import annotations

import torch


def rope_cos_sin_torch(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [...]`` -> fp32 ``(cos, sin)`` of shape ``[..., rope_dim / 2]``: the angle
    ``pos * inv_freq`` in fp32, both scaled by ``attention_factor``."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


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
