"""The installed DeepGEMM module, for the GPU tests that run its kernels: a test skips, with the
adapter's reason, where DeepGEMM is missing or unusable (no GPU, a wheel for another torch)."""

from __future__ import annotations

from typing import Any

import pytest


def deep_gemm_or_skip() -> Any:
    """The DeepGEMM module the engine would use; skips the calling test where there is none."""
    from sglang.srt.layers.deep_gemm_adapter import deep_gemm_status

    status = deep_gemm_status()
    if not status.usable:
        pytest.skip(f"DeepGEMM unusable here: {status.reason}")
    return status.module
