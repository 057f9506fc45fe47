"""Which MoE outputs reach the NCCL symmetric pool, seen through the recording fake pool: the
``none`` backend's runner output (what its all-reduce reads) goes there exactly when
``is_allocation_symmetric()`` is true, and the ``ep`` backend's never does (its runner writes into
the rank-local all-to-all receive buffer, whose size differs by rank)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from sglang.srt.distributed.symm_mem import allocator as pa
from sglang.srt.distributed.symm_mem import output_scope
from sglang.srt.layers.dp_attention import (
    DpPaddingMode,
    _DpGatheredBufferWrapper,
    is_allocation_symmetric,
    set_dp_attention_config,
    set_dp_buffer_len,
)
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
from sglang.srt.layers.moe.topk import TopKConfig, select_experts
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_symm_mem import FakeGroup, FakeSymmetricPool
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)

E, H, I, K, T = 4, 16, 24, 2, 5


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSymmetricPool]:
    monkeypatch.setattr(pa, "require_nccl_version", lambda *a, **k: (2, 28, 9))
    monkeypatch.setattr(output_scope, "get_tp_group_or_none", lambda: FakeGroup())
    pa.set_symmetric_memory_enabled(True)
    fake = FakeSymmetricPool()
    pa.set_symmetric_pool(fake)
    yield fake
    pa.set_symmetric_memory_enabled(False)
    pa.shutdown_symmetric_memory()
    pa.set_symmetric_pool(None)
    set_dp_attention_config(False)
    _DpGatheredBufferWrapper.reset()


def _routed_into_pool(pool: FakeSymmetricPool, a2a: str) -> int:
    """How many times one forward of a one-rank layer routed allocations to the pool."""
    gen = torch.Generator().manual_seed(3)
    layer = FusedMoE(FusedMoEConfig(E, H, I, K, runner="torch", a2a_backend=a2a))
    layer.load_weights(
        ExpertWeights(torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen))
    )
    x = torch.randn(T, H, generator=gen)
    topk = select_experts(torch.randn(T, E, generator=gen), TopKConfig(K, "softmax"))
    before = len(pool.events)
    layer(x, topk)
    return sum(1 for kind, _ in pool.events[before:] if kind == "route_enter")


@pytest.mark.parametrize(
    ("dp", "mode", "symmetric"),
    [
        (False, None, True),
        (True, DpPaddingMode.MAX_LEN, True),
        (True, DpPaddingMode.SUM_LEN, False),
    ],
)
def test_pool_only_when_allocation_is_symmetric(
    pool: FakeSymmetricPool, dp: bool, mode: DpPaddingMode | None, symmetric: bool
) -> None:
    set_dp_attention_config(dp, dp_size=2 if dp else 1)
    if mode is not None:
        set_dp_buffer_len(T, T, mode, [T, T])
    assert is_allocation_symmetric() is symmetric
    assert _routed_into_pool(pool, "none") == (1 if symmetric else 0)
    assert _routed_into_pool(pool, "ep") == 0


if __name__ == "__main__":
    run_this_file(__file__)
