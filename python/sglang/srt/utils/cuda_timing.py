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


def graph_bench_us(fn: Callable[[], object], rep: int = 100) -> float:
    """Microseconds of ``fn`` under CUDA-graph replay (``triton.testing.do_bench_cudagraph`` over
    about ``rep`` ms), after one eager call outside the graph (compiles, first-call work)."""
    import triton.testing  # lazily: this module is imported where triton is not needed

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep)) * 1e3


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


def graph_kernel_table(fn: Callable[[], object], title: str, top: int = 14) -> str:
    """The kernels of one CUDA-graph replay of ``fn`` by device time (torch.profiler over five
    replays): a header with the total time and launches, then the ``top`` kernels."""
    from torch.profiler import ProfilerActivity, profile

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    reps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / reps
    launches = sum(e.count for e in events) // reps
    lines = [
        f"kernels of one replay, {title}: {total:.1f} us, {launches} launches, {len(events)} kinds"
    ]
    for e in events[:top]:
        lines.append(f"  {e.device_time_total / reps:>8.1f} us  x{e.count // reps:<3} {e.key[:90]}")
    return "\n".join(lines)
