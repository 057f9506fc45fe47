"""What one fused-MoE layer is: its expert shapes, activation, runner and a2a backend names, and
how many expert-parallel ranks the backend spreads the experts over."""

from __future__ import annotations

from dataclasses import dataclass

# A ``--moe-a2a-backend`` name: a key of ``a2a.MOE_A2A_BACKENDS`` ("none", "megamoe", ...).
A2ABackend = str


@dataclass(frozen=True)
class FusedMoEConfig:
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    activation: str = "swiglu"
    swiglu_limit: float | None = None
    runner: str = "auto"
    a2a_backend: A2ABackend = "none"
    # Expert-parallel ranks (``--ep-size``); None: the backend's own (the whole TP group for an
    # expert-parallel backend, 1 for ``none``).
    ep_size: int | None = None
