"""DP attention over gloo on 4 ranks (TP=4, DP=2, attention TP=2): the process groups, the hook
the MoE side calls (dp_gather / dp_scatter) in both padding modes with mixed lengths and an idle
group (each attention-TP rank sending only its share of the group's rows),
is_allocation_symmetric per step, and every group's logits reaching rank 0."""

from __future__ import annotations

from typing import Any

import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.multiprocess import run_distributed
from sglang.test.run import run_this_file

register_cpu_ci(est_time=15)

H = 3
CASES = [((2, 5), "sum_len"), ((2, 5), "max_len"), ((4, 0), "max_len"), ((0, 3), "sum_len")]
# (odd maxima: a group's rows do not split evenly over its two ranks, so the share is padded)


def _rows(group: int, n: int) -> torch.Tensor:
    """Group ``group``'s hidden rows: distinct values, the same on the ranks of one group."""
    return torch.arange(n * H, dtype=torch.float32).view(n, H) + 100.0 * (group + 1)


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers import dp_attention as dpa
    from sglang.srt.model_executor.dp_step import gather_dp_logits

    ps.initialize_model_parallel(world_size, attention_dp_size=2)
    dpa.set_dp_attention_config(True, dp_size=2, attn_tp_size=2)
    out: dict[str, Any] = {
        "dp_rank": ps.get_attention_dp_rank(),
        "attn_ranks": ps.get_attn_tp_group().ranks,
        "symmetric_before_any_step": dpa.is_allocation_symmetric(),
        "cases": [],
    }
    g = out["dp_rank"]
    tp = ps.get_tp_group()
    real_all_gather = tp.all_gather
    sent: list[int] = []

    def recording_all_gather(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        sent.append(x.shape[0])
        return real_all_gather(x, dim)

    tp.all_gather = recording_all_gather  # type: ignore[method-assign]
    for counts, padding in CASES:
        dpa.set_dp_state_for_step(counts, dpa.DpPaddingMode(padding), g)
        local = _rows(g, counts[g])
        gathered = dpa.dp_gather(local)
        back = dpa.dp_scatter(gathered)
        out["cases"].append((gathered, torch.equal(back, local), dpa.is_allocation_symmetric()))
    tp.all_gather = real_all_gather  # type: ignore[method-assign]
    out["sent"] = sent
    logits = torch.full((counts[g], 4), float(g)) if counts[g] else None
    out["logits"] = gather_dp_logits(logits, torch.device("cpu"))
    dpa.set_dp_attention_config(False)
    ps.destroy_model_parallel()
    return out


def _expected(counts: tuple[int, int], padding: str) -> torch.Tensor:
    if padding == "sum_len":
        return torch.cat([_rows(g, n) for g, n in enumerate(counts)])
    biggest = max(counts)
    parts = []
    for g, n in enumerate(counts):
        parts += [_rows(g, n), torch.zeros(biggest - n, H)]
    return torch.cat(parts)


def test_dp_gather_scatter_on_four_ranks() -> None:
    results = run_distributed(_rank, 4)
    assert [r["dp_rank"] for r in results] == [0, 0, 1, 1]
    assert [r["attn_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert not any(r["symmetric_before_any_step"] for r in results), "SUM_LEN until a step"
    for i, (counts, padding) in enumerate(CASES):
        want = _expected(counts, padding)
        for r in results:
            gathered, scattered_back, symmetric = r["cases"][i]
            assert torch.equal(gathered, want), (counts, padding, gathered)
            assert scattered_back
            assert symmetric == (padding == "max_len")
    # One all-gather a case, and each rank of a group sends half its group's (padded) rows: every
    # group's rows travel once, not once per attention-TP rank.
    for r in results:
        assert r["sent"] == [-(-max(counts) // 2) for counts, _ in CASES]
    # The last case: group 0 idle, group 1 with 3 rows; only rank 0 receives.
    assert torch.equal(results[0]["logits"], torch.full((3, 4), 1.0))
    assert all(r["logits"] is None for r in results[1:])


if __name__ == "__main__":
    run_this_file(__file__)
