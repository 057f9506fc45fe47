"""Registration markers for test files, in the style of SGLang's registered tests.

Each test file calls one marker at module level to say what hardware it needs and roughly how
long it takes. At run time the markers only attach a pytest mark to the module; the suite runner
and ``conftest.py`` use those marks to skip GPU files on machines without a GPU.
"""

from __future__ import annotations

import inspect

import pytest


def _mark_caller(mark: pytest.MarkDecorator) -> None:
    frame = inspect.stack()[2].frame
    existing = frame.f_globals.get("pytestmark", [])
    if not isinstance(existing, list):
        existing = [existing]
    frame.f_globals["pytestmark"] = [*existing, mark]


def register_cpu_ci(est_time: float, suite: str = "cpu") -> None:
    """A test that runs anywhere, CI included."""
    _mark_caller(pytest.mark.cpu)


def register_cuda_ci(est_time: float, suite: str = "gpu-1", num_gpus: int = 1) -> None:
    """A test that needs ``num_gpus`` CUDA GPUs; skipped where they are missing."""
    _mark_caller(pytest.mark.gpu if num_gpus == 1 else pytest.mark.multi_gpu)
