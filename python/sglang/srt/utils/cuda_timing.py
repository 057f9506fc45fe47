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


def median_graph_replay_ms(fn: Callable[[], object], replays: int, rounds: int = 5) -> float:
    """Median per-replay milliseconds of ``fn`` captured in one CUDA graph (warmed up twice on a
    side stream first: compiles, settles the allocator), over ``rounds`` of ``replays``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a private pool each: a shared one trips an allocator assert
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / replays)
    del graph
    return statistics.median(times)
