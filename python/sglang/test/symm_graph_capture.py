"""CUDA-graph capture with the symmetric pool told about the graph's private pool, as the decode
graphs capture (``CudaGraphRunner.capture``), for the tests of the symmetric pool on the GPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from sglang.srt.distributed.symm_mem.allocator import set_graph_pool_id


@contextmanager
def capture_in_graph_pool(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> Iterator[None]:
    """Capture into ``graph`` on ``stream`` in a fresh private pool, which the symmetric pool
    knows (``set_graph_pool_id``) for the capture only, however it ends."""
    graph_pool = torch.cuda.graph_pool_handle()
    set_graph_pool_id(graph_pool)
    try:
        with torch.cuda.graph(graph, pool=graph_pool, stream=stream):
            yield
    finally:
        set_graph_pool_id(None)
