"""The a2a backends (``--moe-a2a-backend``) own dispatch, combine and the one MoE all-reduce;
FusedMoE.forward is the same dispatch -> runner -> combine for every one of them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.moe.a2a import (
    MOE_A2A_BACKENDS,
    DispatchOutput,
    MoEA2ABackend,
    mega_moe_a2a,
)
from sglang.srt.layers.moe.a2a import base as a2a_base
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
from sglang.srt.layers.moe.topk import TopKConfig, TopKOutput, select_experts
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)

E, H, I, K, T = 8, 32, 48, 2, 5


def _layer(a2a: str, tp_rank: int = 0, tp_size: int = 1) -> FusedMoE:
    gen = torch.Generator().manual_seed(7)
    layer = FusedMoE(
        FusedMoEConfig(E, H, I, K, runner="torch", a2a_backend=a2a),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    layer.load_weights(
        ExpertWeights(
            torch.randn(E, 2 * I, H, generator=gen) * 0.1, torch.randn(E, H, I, generator=gen) * 0.1
        )
    )
    return layer


def _inputs() -> tuple[torch.Tensor, TopKOutput, torch.Tensor]:
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(T, H, generator=gen)
    topk = select_experts(torch.randn(T, E, generator=gen), TopKConfig(K, "sqrtsoftplus"))
    return x, topk, torch.randn(T, H, generator=gen)


class _Reduces:
    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.clone())
        return 2 * x  # "the other rank" holds the same partial sum


@pytest.fixture
def reduce(monkeypatch: pytest.MonkeyPatch) -> _Reduces:
    """The tensor-parallel all-reduce the a2a backends call, recorded (a fake second rank)."""
    fake = _Reduces()
    monkeypatch.setattr(a2a_base, "tensor_model_parallel_all_reduce", fake)
    return fake


def test_registry_names_the_backends_and_refuses_others() -> None:
    assert {"none", "ep", "megamoe"} <= set(MOE_A2A_BACKENDS.names())
    with pytest.raises(ValueError, match="unknown MoE a2a backend 'deepep'.*megamoe"):
        FusedMoE(FusedMoEConfig(E, H, I, K, runner="torch", a2a_backend="deepep"))
    with pytest.raises(
        ValueError,
        match="megamoe places whole experts on each rank: 8 experts do not divide over 3",
    ):
        FusedMoE(FusedMoEConfig(E, H, I, K, runner="torch", a2a_backend="megamoe"), tp_size=3)


def test_tensor_parallel_combine_adds_shared_in_place_then_reduces_once(
    reduce: _Reduces,
) -> None:
    x, topk, shared = _inputs()
    layer = _layer("none", tp_rank=0, tp_size=2)
    assert layer.a2a.shared_expert_tp == (0, 2) and len(layer.local_intermediate) == I // 2
    assert layer.weights is not None
    routed = layer.runner.run(x, topk, layer.weights)
    out = layer(x, topk, shared=shared)
    assert len(reduce.seen) == 1  # one all-reduce, of routed + shared together
    torch.testing.assert_close(reduce.seen[0], routed + shared)
    torch.testing.assert_close(out, 2 * (routed + shared))


def test_megamoe_fallback_reduces_local_experts_and_adds_shared_after(
    reduce: _Reduces, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mega_moe_a2a, "get_deep_gemm", lambda: None)  # no kernel: the runner
    x, topk, shared = _inputs()
    layer = _layer("megamoe", tp_rank=1, tp_size=2)
    assert layer.a2a.shared_expert_tp == (0, 1) and layer.local_experts == range(4, 8)
    out = layer(x, topk, shared=shared)
    full = _layer("none")
    mine = topk.topk_ids >= 4
    local = TopKOutput(
        torch.where(mine, topk.topk_weights, 0.0), torch.where(mine, topk.topk_ids, -1)
    )
    want_partial = full(x, local)  # rank 1's experts alone, on the full layer
    assert len(reduce.seen) == 1
    torch.testing.assert_close(reduce.seen[0], want_partial, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, 2 * want_partial + shared, rtol=1e-5, atol=1e-5)


def test_megamoe_kernel_rows_skip_the_runner_and_the_reduce(
    reduce: _Reduces, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, topk, shared = _inputs()
    kernel_rows = torch.randn(T, H)
    layer = _layer("megamoe", tp_rank=0, tp_size=2)
    monkeypatch.setattr(
        layer.a2a, "kernel", lambda w: SimpleNamespace(combined_rows=lambda *a: kernel_rows)
    )

    def no_runner(*a: object, **kw: object) -> torch.Tensor:
        raise AssertionError("the runner ran although the kernel combined the rows")

    monkeypatch.setattr(layer.runner, "run", no_runner)
    torch.testing.assert_close(layer(x, topk, shared=shared), kernel_rows + shared)
    assert reduce.seen == []


def test_a_new_backend_is_one_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """FusedMoE needs no change for a new backend: it only calls dispatch, the runner and
    combine, in that order."""
    calls: list[str] = []

    class Doubling(MoEA2ABackend):
        name = "doubling"

        def dispatch(
            self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights
        ) -> DispatchOutput:
            calls.append("dispatch")
            return DispatchOutput(2 * hidden, topk)

        def combine_routed(
            self, routed_out: torch.Tensor, dispatched: DispatchOutput
        ) -> torch.Tensor:
            calls.append("combine")
            return -routed_out

    monkeypatch.setitem(MOE_A2A_BACKENDS._factories, "doubling", Doubling)
    x, topk, _ = _inputs()
    layer = _layer("doubling")
    assert layer.weights is not None
    torch.testing.assert_close(layer(x, topk), -layer.runner.run(2 * x, topk, layer.weights))
    assert calls == ["dispatch", "combine"]


if __name__ == "__main__":
    run_this_file(__file__)
