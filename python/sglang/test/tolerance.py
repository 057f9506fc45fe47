"""Comparing a kernel's bf16 outputs with a torch chain that computes the same fp32 values in a
different order: the two fp32 results differ by a little relative to the largest value, and each
is then rounded to bf16, so an entry may differ by one bf16 ulp of the larger of the pair plus that
fp32 difference (which dominates where an entry is tiny next to the largest, e.g. after RoPE
cancels two terms)."""

from __future__ import annotations

import torch


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at each entry's magnitude (8 significand bits)."""
    mag = x.float().abs().clamp_min(2.0**-120)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def bf16_mismatches(got: torch.Tensor, want: torch.Tensor, fp32_tol: float) -> torch.Tensor:
    """Mask of entries beyond one bf16 ulp (of the larger of the pair) plus ``fp32_tol`` times
    the largest wanted magnitude."""
    a, b = got.float(), want.float()
    slack = fp32_tol * float(b.abs().max()) if b.numel() else 0.0
    return (a - b).abs() > ulp_bf16(torch.maximum(a.abs(), b.abs())) + slack


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, fp32_tol: float) -> None:
    bad = bf16_mismatches(got, want, fp32_tol)
    if bad.any():
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} bf16 entries beyond one ulp + {fp32_tol:g} of the "
            f"largest: got {got.float()[bad][:6].tolist()}, want {want.float()[bad][:6].tolist()}"
        )
