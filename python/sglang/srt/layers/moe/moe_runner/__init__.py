"""MoE runners behind one registry (``--moe-runner-backend``)."""

from __future__ import annotations

from sglang.srt.layers.moe.moe_runner.base import MoERunConfig, MoERunner
from sglang.srt.layers.moe.moe_runner.registry import MOE_RUNNERS, create_moe_runner

__all__ = ["MOE_RUNNERS", "MoERunConfig", "MoERunner", "create_moe_runner"]
