"""The Engine-level graph check, shared by the DeepSeek V4 and Kimi K3 GPU tests: the same
requests served with decode CUDA graphs and with the same static decode run eagerly at the same
padded batch sizes (``SGLANG_STATIC_DECODE_WITHOUT_GRAPHS`` with ``--disable-cuda-graph``): the
same kernels on the same shapes, so the greedy tokens must be equal by construction."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

Outputs = list[list[int]]

# fp32 with the triton MoE runner (capturable; fp32 so rounding cannot flip a token between the
# two engines' other code), at most 8-row graphs, 16-token prefill chunks (many mixed steps).
GRAPH_CHECK_ENGINE_ARGS: Mapping[str, Any] = {
    "device": "cuda",
    "dtype": "float32",
    "moe_runner_backend": "triton",
    "random_seed": 0,
    "log_level": "warning",
    "cuda_graph_max_bs": 8,
    "chunked_prefill_size": 16,
}


def serve_eager_static_then_graphs(
    common: Mapping[str, Any],
    run: Callable[[Any], Outputs],
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[Outputs, Outputs, str, str]:
    """``run(engine)`` -> output ids per request, in both engines; returns (eager static, graph)
    outputs and each engine's ``cuda_graph`` startup line."""
    from sglang import Engine

    monkeypatch.setenv("SGLANG_STATIC_DECODE_WITHOUT_GRAPHS", "1")
    with Engine(**common, disable_cuda_graph=True) as eager:
        want = run(eager)
        off = eager.get_server_info()["model_info"]["cuda_graph"]
    monkeypatch.delenv("SGLANG_STATIC_DECODE_WITHOUT_GRAPHS")
    with Engine(**common) as graphs:
        got = run(graphs)
        on = graphs.get_server_info()["model_info"]["cuda_graph"]
    assert off.startswith("off (disabled by --disable-cuda-graph); static decode eager at the"), off
    return want, got, off, on


def assert_same_tokens(got: Outputs, want: Outputs) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        first = next((t for t, (a, b) in enumerate(zip(g, w)) if a != b), None)
        assert g == w, f"request {i}: graph and eager static decode part at output token {first}"
