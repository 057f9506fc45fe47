"""Comparing a kernel's bf16 outputs with a torch chain that computes the same fp32 values in a
different order: the two fp32 results differ by a little relative to the largest value, and each
is then rounded to bf16, so an entry may differ by one bf16 ulp of the larger of the pair plus that
fp32 difference (which dominates where an entry is tiny next to the largest, e.g. after RoPE
cancels two terms)."""

from __future__ import annotations

import torch

MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each entry's magnitude (fp64, so a value just below a power of
    two keeps the smaller spacing)."""
    mag = x.double().abs().clamp_min(1e-30)
    return torch.exp2(torch.floor(torch.log2(mag)) - MANTISSA_BITS[dtype])


def bf16_mismatches(got: torch.Tensor, want: torch.Tensor, fp32_tol: float) -> torch.Tensor:
    """Mask of entries beyond one bf16 ulp (of the larger of the pair) plus ``fp32_tol`` times
    the largest wanted magnitude."""
    a, b = got.double(), want.double()
    slack = fp32_tol * float(b.abs().max()) if b.numel() else 0.0
    return (a - b).abs() > ulp(torch.maximum(a.abs(), b.abs()), torch.bfloat16) + slack


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, fp32_tol: float) -> None:
    bad = bf16_mismatches(got, want, fp32_tol)
    if bad.any():
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} bf16 entries beyond one ulp + {fp32_tol:g} of the "
            f"largest: got {got.float()[bad][:6].tolist()}, want {want.float()[bad][:6].tolist()}"
        )


def rel_max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got - want).abs().max() / want.abs().max())


def rel_norm_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius, in fp64)."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()
