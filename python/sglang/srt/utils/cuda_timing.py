"""Timing GPU work with CUDA events (device time, not host time)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_cuda_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs, after one warm-up run."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)
