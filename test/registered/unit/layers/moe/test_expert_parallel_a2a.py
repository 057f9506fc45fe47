"""The ``ep`` a2a backend (all-to-all dispatch and combine) over gloo equals the TP=1 layer, for
row counts that split unevenly, one row (a rank with nothing to send) and none: at two ranks with
whole experts (EP=2), and at four ranks with EP=2 (each expert's intermediate dim sliced over the
two ranks that hold it, their partial sums reduced); the receive buffer is the runner's output,
so nothing of a rank-dependent size reaches the symmetric pool."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from sglang.srt.distributed.moe_groups import moe_group_ranks
from sglang.srt.layers.moe.a2a.expert_parallel_a2a import row_slice
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
from sglang.srt.layers.moe.topk import TopKConfig, TopKOutput, select_experts
from sglang.srt.model_executor.cuda_graph_runner import graph_unavailable_reason
from sglang.test.ci_register import register_cpu_ci
from sglang.test.multiprocess import run_distributed
from sglang.test.run import run_this_file

register_cpu_ci(est_time=20)

E, H, I, K = 8, 32, 48, 3
ROWS = (11, 1, 0, 6)


def _layer(tp_rank: int, tp_size: int, a2a: str, ep_size: int | None = None) -> FusedMoE:
    gen = torch.Generator().manual_seed(7)
    weights = ExpertWeights(
        torch.randn(E, 2 * I, H, generator=gen) * 0.1, torch.randn(E, H, I, generator=gen) * 0.1
    )
    config = FusedMoEConfig(E, H, I, K, runner="torch", a2a_backend=a2a, ep_size=ep_size)
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


def _rank(rank: int, world: int, ep_size: int) -> list[torch.Tensor]:
    from sglang.srt.distributed import parallel_state as ps

    # One thread a rank: more ranks than cores, and every collective waits for the slowest.
    torch.set_num_threads(1)
    ps.initialize_model_parallel(world)
    layer = _layer(rank, world, "ep", ep_size)
    moe_tp = world // ep_size
    assert layer.weights is not None
    assert tuple(layer.weights.w13.shape) == (E // ep_size, 2 * I // moe_tp, H)
    outs = [layer(*_inputs(rows), shared=torch.ones(rows, H)) for rows in ROWS]
    ps.destroy_model_parallel()
    return outs


@pytest.mark.parametrize(("world", "ep_size"), [(2, 2), (4, 2)])
def test_ep_equals_tp1(world: int, ep_size: int) -> None:
    one = _layer(0, 1, "none")
    want = [one(*_inputs(rows)) + 1.0 for rows in ROWS]
    for rank, outs in enumerate(run_distributed(_rank, world, ep_size)):
        for rows, got, ref in zip(ROWS, outs, want, strict=True):
            assert got.shape == (rows, H)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {rows}")


def test_ep_below_tp_places_experts_and_slices() -> None:
    """TP=4, EP=2: ranks 0, 1 hold experts 0..3, ranks 2, 3 experts 4..7; within each pair
    rank 2j holds the first half of every intermediate dim, rank 2j+1 the second."""
    got = []
    for r in range(4):
        layer = _layer(r, 4, "ep", 2)
        a2a = layer.a2a
        got.append((a2a.ep_rank, a2a.moe_tp_rank, layer.local_experts, layer.local_intermediate))
    half = I // 2
    assert got == [
        (0, 0, range(4), range(half)),
        (0, 1, range(4), range(half, I)),
        (1, 0, range(4, 8), range(half)),
        (1, 1, range(4, 8), range(half, I)),
    ]
    assert layer.expert_parallel and layer.a2a.shared_expert_tp == (0, 1)


def test_moe_group_ranks() -> None:
    ep, moe_tp = moe_group_ranks(8, 4, 2)  # two TP groups of 4, EP=2 in each
    assert moe_tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ep == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ValueError, match="ep size 3 must divide tp size 4"):
        moe_group_ranks(4, 4, 3)


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
    with pytest.raises(ValueError, match="needs --ep-size \\(3\\) to divide --tp-size \\(4\\)"):
        FusedMoE(FusedMoEConfig(E, H, I, K, runner="torch", a2a_backend="ep", ep_size=3), tp_size=4)
    with pytest.raises(
        ValueError, match="over tp_size / ep_size = 4 ranks: intermediate size 50 is not"
    ):
        FusedMoE(
            FusedMoEConfig(E, H, 48 + 2, K, runner="torch", a2a_backend="ep", ep_size=2), tp_size=8
        )


def test_megamoe_refuses_ep_below_tp() -> None:
    config = FusedMoEConfig(E, H, I, K, runner="torch", a2a_backend="megamoe", ep_size=2)
    with pytest.raises(
        ValueError, match="megamoe needs --ep-size equal to --tp-size 4.*use --moe-a2a-backend ep"
    ):
        FusedMoE(config, tp_size=4)


def test_tensor_parallel_refuses_an_ep_size() -> None:
    config = FusedMoEConfig(E, H, I, K, runner="torch", a2a_backend="none", ep_size=2)
    with pytest.raises(ValueError, match="none is tensor parallel: its ep size must be 1"):
        FusedMoE(config, tp_size=2)


if __name__ == "__main__":
    run_this_file(__file__)
