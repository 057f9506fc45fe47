"""Skip tests whose hardware is missing, so one command runs everywhere."""

from __future__ import annotations

import pytest
import torch


def _num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = _num_gpus()
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))
        need = item.get_closest_marker("needs_gpus")
        if need is not None and gpus < int(need.args[0]):
            item.add_marker(pytest.mark.skip(reason=f"needs {need.args[0]} CUDA GPUs"))
