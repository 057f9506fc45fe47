"""DP attention on both models' tiny configs (fp32, torch runner, gloo ranks) gives TP=1's greedy
tokens: TP=2 DP=2 (attention TP=1) and TP=4 DP=2 (attention TP=2, attention all-reduced within
each group of two), with the MoE over every rank on the gathered rows; and both again with EP=2
(the ``ep`` a2a backend on the gathered rows: whole experts a rank at TP=2, half the experts
each sliced over two ranks at TP=4).

Each rank runs what ``dp_step`` runs: the step's DP state, then its group's requests or, for an
idle group, ``forward_idle``. The steps: a prefill of mixed lengths in each group (``sum_len``),
batched decodes (``max_len``), then group 0 idle while group 1 prefills and decodes a new prompt.
The recording fake ``use_symmetric_memory`` shows the pool used exactly on the steps where
``is_allocation_symmetric()`` is true (a ``max_len`` step), and never on a ``sum_len`` one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.dp_attention_parity import DECODES, greedy, load_dsv4, load_kimi, run_rank
from sglang.test.dsv4_tiny import CONFIG_A as DSV4_CONFIG
from sglang.test.dsv4_tiny import reference_model, write_release
from sglang.test.kimi_k3_tiny import CONFIG_A as KIMI_CONFIG
from sglang.test.kimi_k3_tiny import make_model
from sglang.test.moe_placement import expert_placement
from sglang.test.multiprocess import run_distributed
from sglang.test.release_checkpoint import kimi_k3 as k3_release
from sglang.test.run import run_this_file

register_cpu_ci(est_time=100)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both checkpoints (DSv4 on disk, Kimi K3 as tensors) and TP=1's run of the schedule."""
    path = tmp_path_factory.mktemp("dsv4")
    write_release(path, DSV4_CONFIG, reference_model(DSV4_CONFIG, seed=21))
    kimi_ckpt = dict(
        k3_release.model_release_tensors(make_model(KIMI_CONFIG, seed=22), experts="bf16").tensors
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is faster on a busy CPU
    try:
        want = {
            "dsv4": greedy(load_dsv4(str(path), 0, 1), DSV4_CONFIG["vocab_size"], None),
            "kimi": greedy(
                load_kimi(KIMI_CONFIG, kimi_ckpt, 0, 1), KIMI_CONFIG["vocab_size"], None
            ),
        }
    finally:
        torch.set_num_threads(threads)
    return {"path": str(path), "kimi_ckpt": kimi_ckpt, "want": want}


def _check(world: int, ref: dict[str, Any], ep_size: int | None = None) -> None:
    want = ref["want"]
    args = (ref["path"], DSV4_CONFIG["vocab_size"], KIMI_CONFIG, ref["kimi_ckpt"], ep_size)
    results = run_distributed(run_rank, world, *args, timeout_s=300)
    attn_tp = world // 2
    assert [r["dp_rank"] for r in results] == [r // attn_tp for r in range(world)]
    for rank, got in enumerate(results):
        g = got["dp_rank"]
        # each rank holds its EP rank's experts (and its MoE-TP slice of them), or, without
        # EP, every expert's 1/T intermediate slice
        experts = (DSV4_CONFIG["n_routed_experts"], KIMI_CONFIG["num_experts"])
        inter = (DSV4_CONFIG["moe_intermediate_size"], KIMI_CONFIG["moe_intermediate_size"])
        held = tuple(
            expert_placement(rank, world, ep_size or 1, e, i) for e, i in zip(experts, inter)
        )
        assert got["held"] == held, (rank, got["held"], held)
        assert got["dsv4_heads"] == {DSV4_CONFIG["num_attention_heads"] // attn_tp}
        assert got["kimi_heads"] == {KIMI_CONFIG["num_attention_heads"] // attn_tp}
        for name in ("dsv4", "kimi"):
            mine, tp1 = got[name], want[name]
            assert mine["tokens"][g] == tp1["tokens"][g], (rank, name, mine["tokens"], tp1)
            modes = [m for m, _ in mine["modes"]]
            # mixed prefills and the idle group's steps pack; balanced decodes pad to the max
            assert modes == ["sum_len"] + ["max_len"] * DECODES + ["sum_len"] * 2, modes
            for (mode, symmetric), pooled in zip(mine["modes"], mine["pool_allocs"]):
                assert symmetric == (mode == "max_len")
                # the gathered buffer and every MoE output go to the pool only when symmetric
                assert (pooled > 0) == symmetric, (rank, name, mode, pooled)
    # Attention weights are sharded over the attention-TP group: rank r holds slice r % (T/D),
    # the same in every DP group, and the slices of one group differ.
    for rank, got in enumerate(results):
        twin = results[rank % attn_tp]["attn_weights"]
        assert all(torch.equal(a, b) for a, b in zip(got["attn_weights"], twin, strict=True))
        if attn_tp > 1 and rank % attn_tp:
            first = results[rank - rank % attn_tp]["attn_weights"]
            assert not any(torch.equal(a, b) for a, b in zip(got["attn_weights"], first))
    for name in ("dsv4", "kimi"):
        # the tokens are not trivially constant
        assert len({t for grp in want[name]["tokens"] for row in grp for t in row}) > 2


def test_dp2_attention_tp1_greedy_tokens_equal_tp1(reference: dict[str, Any]) -> None:
    _check(2, reference)


def test_dp2_attention_tp2_greedy_tokens_equal_tp1(reference: dict[str, Any]) -> None:
    _check(4, reference)


def test_dp2_ep2_greedy_tokens_equal_tp1(reference: dict[str, Any]) -> None:
    """DP=2 + EP=2 (TP=2): the gathered rows go to the experts' owners by all-to-all, whole
    experts a rank."""
    _check(2, reference, ep_size=2)


def test_dp2_attention_tp2_ep2_greedy_tokens_equal_tp1(reference: dict[str, Any]) -> None:
    """DP=2 with attention TP=2 (TP=4) + EP=2: half the experts a rank, each expert's
    intermediate dim sliced over the two ranks that hold it (E < T)."""
    _check(4, reference, ep_size=2)


if __name__ == "__main__":
    run_this_file(__file__)
