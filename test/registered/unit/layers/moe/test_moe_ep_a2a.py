"""The ``ep`` a2a backend (all-to-all dispatch and combine, whole experts a rank) at two ranks
over gloo equals the TP=1 layer, for row counts that split unevenly, one row (a rank with
nothing to send) and none; the receive buffer is the runner's output, so nothing of a
rank-dependent size reaches the symmetric pool."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from sglang.srt.layers.moe.a2a.expert_parallel_a2a import row_slice
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
from sglang.srt.layers.moe.topk import TopKConfig, TopKOutput, select_experts
from sglang.srt.model_executor.cuda_graph_runner import graph_unavailable_reason
from sglang.test.ci_register import register_cpu_ci
from sglang.test.multiprocess import run_distributed
from sglang.test.run import run_this_file

register_cpu_ci(est_time=10)

E, H, I, K = 8, 32, 48, 3
ROWS = (11, 1, 0, 6)


def _layer(tp_rank: int, tp_size: int, a2a: str) -> FusedMoE:
    gen = torch.Generator().manual_seed(7)
    weights = ExpertWeights(
        torch.randn(E, 2 * I, H, generator=gen) * 0.1, torch.randn(E, H, I, generator=gen) * 0.1
    )
    config = FusedMoEConfig(E, H, I, K, runner="torch", a2a_backend=a2a)
    layer = FusedMoE(config, tp_rank=tp_rank, tp_size=tp_size)
    layer.load_weights(weights)
    return layer


def _inputs(rows: int) -> tuple[torch.Tensor, TopKOutput]:
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, H, generator=gen)
    topk = select_experts(torch.randn(rows, E, generator=gen), TopKConfig(K, "softmax"))
    if rows > 3:  # a skipped slot (-1) must stay skipped
        ids = topk.topk_ids.clone()
        ids[2, 1] = -1
        topk = TopKOutput(topk.topk_weights, ids)
    return x, topk


def _rank(rank: int, world: int) -> list[torch.Tensor]:
    from sglang.srt.distributed import parallel_state as ps

    ps.initialize_model_parallel(world)
    layer = _layer(rank, world, "ep")
    assert layer.weights is not None and layer.weights.w13.shape[0] == E // world
    outs = [layer(*_inputs(rows), shared=torch.ones(rows, H)) for rows in ROWS]
    ps.destroy_model_parallel()
    return outs


def test_ep2_equals_tp1() -> None:
    one = _layer(0, 1, "none")
    want = [one(*_inputs(rows)) + 1.0 for rows in ROWS]
    for rank, outs in enumerate(run_distributed(_rank, 2)):
        for rows, got, ref in zip(ROWS, outs, want, strict=True):
            assert got.shape == (rows, H)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {rows}")


def test_ep_on_one_rank_is_the_plain_layer() -> None:
    x, topk = _inputs(11)
    torch.testing.assert_close(_layer(0, 1, "ep")(x, topk), _layer(0, 1, "none")(x, topk))


@pytest.mark.parametrize("rows", [0, 1, 5, 11])
def test_row_slices_cover_the_rows_once(rows: int) -> None:
    cuts = [row_slice(rows, r, 3) for r in range(3)]
    assert cuts[0][0] == 0 and cuts[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts))


class _StaticModel(torch.nn.Module):
    """A static-decode model (the protocol's members, unused) with one MoE layer."""

    slot_pool = None

    def __init__(self, a2a: str) -> None:
        super().__init__()
        self.moe = _layer(0, 1, a2a)

    def moe_layers(self) -> Iterator[FusedMoE]:
        yield self.moe

    def enable_slot_pool(self, max_slots: int, capacity: int) -> None: ...
    def new_pooled_cache(self) -> None: ...
    def free_pooled_cache(self, cache: object) -> None: ...
    def static_decode(self, *args: object) -> None: ...
    def decode_pooled(self, *args: object, **kwargs: object) -> None: ...


def test_ep_decode_is_not_captured() -> None:
    why = graph_unavailable_reason(_StaticModel("ep"), torch.device("cuda"), disabled=False)
    assert why is not None and "ep a2a backend" in why
    why = graph_unavailable_reason(_StaticModel("none"), torch.device("cuda"), disabled=False)
    assert why is not None and "ep a2a" not in why  # the torch runner's own reason


def test_ep_refuses_experts_that_do_not_divide() -> None:
    with pytest.raises(ValueError, match="8 experts do not divide over 3 ranks"):
        FusedMoE(FusedMoEConfig(E, H, I, K, runner="torch", a2a_backend="ep"), tp_size=3)


if __name__ == "__main__":
    run_this_file(__file__)
