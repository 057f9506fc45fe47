"""Process groups over gloo on CPU ranks in subprocesses: TP all-reduce, ranks, teardown."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sglang.srt.distributed import parallel_state as ps
from sglang.test.ci_register import register_cpu_ci
from sglang.test.multiprocess import DistributedTestError, run_distributed
from sglang.test.run import run_this_file

register_cpu_ci(est_time=25)


def _tp2_checks(rank: int, world_size: int) -> dict[str, object]:
    """Runs on each rank (world 2, TP 2)."""
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_tp_group()
    assert ps.get_tp_group_or_none() is None

    tp = ps.initialize_model_parallel(2)
    assert ps.model_parallel_is_initialized()
    assert ps.get_tp_group() is tp
    assert ps.initialize_model_parallel(2) is tp, "re-initialising with the same size is a no-op"
    with pytest.raises(RuntimeError, match="already initialized"):
        ps.initialize_model_parallel(1)
    assert tp.pynccl_comm is None, "no pynccl on gloo"

    x = torch.arange(6, dtype=torch.float32) * (rank + 1)
    out = ps.tensor_model_parallel_all_reduce(x)
    assert out is x, "the gloo path reduces in place"

    g = tp.all_gather(torch.full((2, 3), float(rank)), dim=1)
    b = tp.broadcast(torch.full((4,), float(rank + 10)), src=1)
    objs = tp.all_gather_object({"rank": rank})
    obj = tp.broadcast_object("from0" if rank == 0 else None, src=0)
    tp.barrier()
    summary = {
        "rank": tp.rank,
        "rank_in_group": tp.rank_in_group,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "ranks": tp.ranks,
        "device": str(tp.device),
        "all_reduce": out,
        "all_gather": g,
        "broadcast": b,
        "objs": objs,
        "obj": obj,
    }
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tp_group_or_none() is None
    ps.destroy_model_parallel()  # idempotent
    ps.destroy_distributed_environment()
    summary["dist_initialized_after_destroy"] = dist.is_initialized()
    return summary


def test_tp2_over_gloo() -> None:
    results = run_distributed(_tp2_checks, 2)
    expected_sum = torch.arange(6, dtype=torch.float32) * 3
    for rank, r in enumerate(results):
        assert r["rank"] == rank and r["rank_in_group"] == rank and r["tp_rank"] == rank
        assert r["tp_size"] == 2 and r["ranks"] == [0, 1] and r["device"] == "cpu"
        torch.testing.assert_close(r["all_reduce"], expected_sum)
        expected_gather = torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], dim=1)
        torch.testing.assert_close(r["all_gather"], expected_gather)
        torch.testing.assert_close(r["broadcast"], torch.full((4,), 11.0))
        assert r["objs"] == [{"rank": 0}, {"rank": 1}]
        assert r["obj"] == "from0"
        assert r["dist_initialized_after_destroy"] is False


def _tp2_of_4(rank: int, world_size: int) -> tuple[list[int], int, list[float]]:
    tp = ps.initialize_model_parallel(2)
    x = torch.tensor([float(rank)])
    world = ps.get_world_group().all_reduce(torch.tensor([1.0]))
    return tp.ranks, tp.rank_in_group, [tp.all_reduce(x).item(), world.item()]


def test_world4_splits_into_consecutive_tp_groups() -> None:
    results = run_distributed(_tp2_of_4, 4)
    assert [r[0] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[1] for r in results] == [0, 1, 0, 1]
    assert [r[2] for r in results] == [[1.0, 4.0], [1.0, 4.0], [5.0, 4.0], [5.0, 4.0]]


def _fails_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one says no")
    return rank


def test_run_distributed_reports_the_failing_rank() -> None:
    with pytest.raises(DistributedTestError, match=r"rank 1 failed:[\s\S]*rank one says no"):
        run_distributed(_fails_on_rank_1, 2, timeout_s=60)


def test_get_tp_group_without_init_names_the_fix() -> None:
    assert ps.get_tp_group_or_none() is None
    with pytest.raises(RuntimeError, match="init_distributed_environment"):
        ps.get_tp_group()
    with pytest.raises(RuntimeError, match="not initialized"):
        ps.tensor_model_parallel_all_reduce(torch.ones(1))


def test_world1_group_returns_input_unchanged() -> None:
    """One process, real gloo group of one rank: all_reduce is the identity."""
    try:
        ps.init_distributed_environment(1, 0, backend="gloo")
        tp = ps.initialize_model_parallel(1)
        x = torch.ones(3)
        assert tp.all_reduce(x) is x
        assert tp.all_gather(x) is x
        torch.testing.assert_close(x, torch.ones(3))
    finally:
        ps.destroy_distributed_environment()
    assert not dist.is_initialized()
    assert not ps.model_parallel_is_initialized()


if __name__ == "__main__":
    run_this_file(__file__)
