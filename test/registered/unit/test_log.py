"""``log_path_once`` says once which path an op takes, the kernel or the torch path with the first
reason seen, whatever the call count and however the reason varies (hot paths call it every
step); and the layers say it: a CPU DeepSeek V4 decode logs its static attention's torch path."""

from __future__ import annotations

import logging

import pytest

from sglang.srt.utils import log
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=5)


def test_once_per_path(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(log, "_paths_said", set())
    logger = logging.getLogger("sglang.test_paths")
    with caplog.at_level(logging.INFO, logger="sglang.test_paths"):
        for i in range(5):
            log.log_path_once(logger, "op A", f"tensor at {i:#x} is misaligned")
            log.log_path_once(logger, "op A", None)
            log.log_path_once(logger, "op B", None)
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang.test_paths"]
    assert lines == [
        "op A: torch path (tensor at 0x0 is misaligned)",
        "op A: Triton kernel",
        "op B: Triton kernel",
    ]


def test_static_decode_says_its_path(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from sglang.srt.layers.attention import dsv4_static_decode

    monkeypatch.setattr(log, "_paths_said", set())

    class _Attn:
        head_dim, indexer = 64, None

    with caplog.at_level(logging.INFO):
        for _ in range(3):
            assert not dsv4_static_decode.use_sparse_kernels(_Attn(), torch.zeros(1, 4, 64))  # type: ignore[arg-type]
    said = [r.getMessage() for r in caplog.records if "static decode attention" in r.getMessage()]
    what = "DeepSeek V4 static decode attention and indexer scores"
    assert said == [f"{what}: torch path (the pool is not on CUDA)"]


if __name__ == "__main__":
    run_this_file(__file__)
