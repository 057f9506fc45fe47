"""MoE all-to-all backends behind one registry (``--moe-a2a-backend``): each owns where this
rank's experts sit, the dispatch of routed rows to them and the combine (with the one
all-reduce, or none) of their outputs."""

from __future__ import annotations

from sglang.srt.layers.moe.a2a.base import DispatchOutput, MoEA2ABackend
from sglang.srt.layers.moe.a2a.registry import MOE_A2A_BACKENDS, create_a2a_backend

__all__ = [
    "MOE_A2A_BACKENDS",
    "DispatchOutput",
    "MoEA2ABackend",
    "create_a2a_backend",
]
