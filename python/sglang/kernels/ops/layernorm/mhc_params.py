"""The constants of one mHC call, as one frozen bundle: what the model fixes (the mixes' RMS eps,
the hyper-connection eps, the Sinkhorn steps) and the sublayer's RMSNorm fused after pre (its
weight and eps, or none). Entry points take it whole; each kernel launch unpacks it into the
kernel's scalar arguments."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class MhcParams:
    rms_eps: float  # eps of the RMS over the whole hc*H row that scales the mixes
    hc_eps: float  # added after the sigmoids and inside every Sinkhorn normalisation
    sinkhorn_iters: int
    # The sublayer's RMSNorm on the layer input (pre and fused post+pre only); None: no norm.
    norm_weight: torch.Tensor | None = None
    norm_eps: float | None = None

    def __post_init__(self) -> None:
        if self.norm_weight is not None and self.norm_eps is None:
            raise ValueError("norm_eps is required with norm_weight")
        if self.sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters must be >= 1, got {self.sinkhorn_iters}")

    @property
    def has_norm(self) -> bool:
        return self.norm_weight is not None

    def with_norm(self, weight: torch.Tensor, eps: float) -> MhcParams:
        """These constants with the sublayer's RMSNorm fused after pre."""
        return replace(self, norm_weight=weight, norm_eps=eps)

    def without_norm(self) -> MhcParams:
        return replace(self, norm_weight=None, norm_eps=None)
