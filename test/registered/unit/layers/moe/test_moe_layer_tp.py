"""The FusedMoE layer at TP=2 over gloo equals TP=1: tensor-parallel experts (sharded
intermediate, all-reduced partial sums) and the expert-parallel MegaMoE layout on its fallback
path (whole experts a rank, foreign ids masked, all-reduced)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
from sglang.srt.layers.moe.topk import TopKConfig, select_experts
from sglang.test.ci_register import register_cpu_ci
from sglang.test.multiprocess import run_distributed
from sglang.test.run import run_this_file

register_cpu_ci(est_time=25)

E, H, I, K, T = 8, 64, 96, 3, 11


def _problem() -> tuple[ExpertWeights, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2024)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * 0.1
    w2 = torch.randn(E, H, I, generator=gen) * 0.1
    x = torch.randn(T, H, generator=gen)
    logits = torch.randn(T, E, generator=gen)
    return ExpertWeights(w13, w2), x, logits


def _forward(tp_rank: int, tp_size: int, a2a: str, reduce: bool = True) -> torch.Tensor:
    weights, x, logits = _problem()
    config = FusedMoEConfig(
        E,
        H,
        I,
        K,
        activation="swiglu",
        swiglu_limit=0.5,
        runner="torch",
        a2a_backend=a2a,
    )
    layer = FusedMoE(config, tp_rank=tp_rank, tp_size=tp_size)
    layer.load_weights(weights)
    topk = select_experts(logits, TopKConfig(K, "sqrtsoftplus"))
    if not reduce:  # the runner's shard alone, before the a2a combine reduces it
        assert layer.weights is not None
        return layer.runner.run(x, topk, layer.weights)
    return layer(x, topk)


def _rank(rank: int, world_size: int, a2a: str) -> torch.Tensor:
    from sglang.srt.distributed import parallel_state as ps

    ps.initialize_model_parallel(world_size)
    out = _forward(rank, world_size, a2a)
    ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("a2a", ["none", "megamoe"])
def test_tp2_equals_tp1(a2a: str) -> None:
    reference = _forward(0, 1, "none")
    results = run_distributed(_rank, 2, a2a)
    for rank, out in enumerate(results):
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
    # the shards alone are not the answer: the reduction matters
    assert not torch.allclose(_forward(0, 2, "none", reduce=False), reference, atol=1e-3)


if __name__ == "__main__":
    run_this_file(__file__)
