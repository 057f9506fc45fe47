"""Where the Triton kernels of this package may run (shared by the ops that fall back to torch)."""

from __future__ import annotations

import os

import torch


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, read on every call
    so a test process can turn it on)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_can_run(t: torch.Tensor) -> bool:
    """CUDA tensors, or any tensor under the Triton interpreter; elsewhere the callers take their
    torch path."""
    return t.is_cuda or interpreter_enabled()
