"""DP attention on both models' tiny configs (fp32, torch runner, gloo ranks) gives TP=1's greedy
tokens: TP=2 DP=2 (attention TP=1) and TP=4 DP=2 (attention TP=2, attention all-reduced within
each group of two), with the MoE over every rank on the gathered rows.

Each rank runs what ``dp_step`` runs: the step's DP state, then its group's requests or, for an
idle group, ``forward_idle``. The steps: a prefill of mixed lengths in each group (``sum_len``),
batched decodes (``max_len``), then group 0 idle while group 1 prefills and decodes a new prompt.
The recording fake ``use_symmetric_memory`` shows the pool used exactly on the steps where
``is_allocation_symmetric()`` is true (a ``max_len`` step), and never on a ``sum_len`` one.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dsv4_testing import CONFIG_A as DSV4_CONFIG
from _dsv4_testing import reference_model
from test_kimi_k3_loading import export_checkpoint
from test_kimi_k3_tiny import CONFIG_A as KIMI_CONFIG
from test_kimi_k3_tiny import config as kimi_config
from test_kimi_k3_tiny import make_model

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.test.ci_register import register_cpu_ci
from sglang.test.multiprocess import run_distributed
from sglang.test.run import run_this_file

register_cpu_ci(est_time=60)

# Prompt lengths of group 0 and group 1 (requests balanced 2 + 2), then group 1's late prompt.
GROUPS = ((9, 17), (1, 4))
LATE = 6
DECODES = 3


def _prompts(vocab: int) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    groups = [[torch.randint(0, vocab, (n,), generator=gen) for n in g] for g in GROUPS]
    return groups, torch.randint(0, vocab, (LATE,), generator=gen)


def _forward(model: Any, rows: list[torch.Tensor], caches: list[Any]) -> torch.Tensor:
    """One forward of ``rows[i]`` appended to ``caches[i]``; each request's last logits row."""
    ids = torch.cat(rows)
    pos = torch.cat([torch.arange(len(c), len(c) + r.shape[0]) for r, c in zip(rows, caches)])
    logits = model(ids, pos, model.batch_type([r.shape[0] for r in rows], caches))
    return logits[torch.cumsum(torch.tensor([r.shape[0] for r in rows]), 0) - 1]


# A group's part of a step: ("new", prompts) ends its requests and prefills these; ("decode",)
# decodes one token of each of its requests; None: the group is idle.
Part = tuple[str, list[torch.Tensor]] | None


def _schedule(vocab: int) -> list[list[Part]]:
    groups, late = _prompts(vocab)
    decode: Part = ("decode", [])
    steps: list[list[Part]] = [[("new", groups[0]), ("new", groups[1])]]
    steps += [[decode, decode] for _ in range(DECODES)]
    return [*steps, [None, ("new", [late])], [None, decode]]


@torch.no_grad()
def _greedy(model: Any, vocab: int, dp_rank: int | None) -> dict[str, Any]:
    """Run the schedule: ``dp_rank`` None is TP=1 (each group's rows in a forward of its own);
    otherwise this rank runs its group's rows, or the idle forward, under the step's DP state.
    Returns every request's tokens per group (this group's only under DP) and, per step, the
    padding mode and whether allocations were symmetric."""
    from sglang.srt.layers import dp_attention as dpa

    active: list[list[tuple[Any, list[int]]]] = [[], []]
    tokens: list[list[list[int]]] = [[], []]
    modes: list[tuple[str, bool]] = []
    for step in _schedule(vocab):
        rows: list[list[torch.Tensor] | None] = []
        for g, part in enumerate(step):
            if part is None:
                rows.append(None)
            elif part[0] == "new":
                active[g] = [(model.new_request_cache(), []) for _ in part[1]]
                tokens[g] += [t for _, t in active[g]]
                rows.append(part[1])
            else:
                # (another group's rows under DP: only their count matters here)
                rows.append([torch.tensor([t[-1] if t else 0]) for _, t in active[g]])
        counts = tuple(0 if r is None else sum(x.shape[0] for x in r) for r in rows)
        if dp_rank is not None:
            mode = dpa.choose_dp_padding(counts)
            dpa.set_dp_state_for_step(counts, mode, dp_rank)
            modes.append((mode.value, dpa.is_allocation_symmetric()))
        for g, r in enumerate(rows):
            if dp_rank is not None and g != dp_rank:
                continue
            if r is None:
                if dp_rank is not None:
                    assert model.forward_idle().shape == (0, vocab)
                continue
            last = _forward(model, r, [c for c, _ in active[g]])
            for (_, toks), t in zip(active[g], last.argmax(-1).tolist()):
                toks.append(int(t))
        if dp_rank is not None:
            dpa.reset_dp_state()
    return {"tokens": tokens, "modes": modes}


def _spec(rank: int, world: int) -> LayerBuildSpec:
    return LayerBuildSpec(dtype=torch.float32, tp_rank=rank, tp_size=world, moe_runner="torch")


def _load_dsv4(path: str, rank: int, world: int) -> Any:
    from sglang.srt.model_loader.deepseek_v4_loader import load_deepseek_v4

    return load_deepseek_v4(path, _spec(rank, world), LoadOptions(progress=False))


def _load_kimi(ckpt: dict[str, torch.Tensor], rank: int, world: int) -> Any:
    from sglang.srt.model_loader.kimi_k3_loader import load_weights
    from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM

    model = KimiK3ForCausalLM(kimi_config(KIMI_CONFIG), _spec(rank, world))
    load_weights(model, ckpt, LoadOptions(progress=False))
    return model


def _run_recorded(model: Any, vocab: int, dp_rank: int) -> dict[str, Any]:
    """:func:`_greedy` with the recording fake in place of the pool: per step, how many storages
    were created in enabled (pool) scopes."""
    from sglang.srt.layers import dp_attention as dpa
    from sglang.test.alloc_recorder import SymmetricScopeRecorder

    real = dpa.use_symmetric_memory
    rec = SymmetricScopeRecorder()
    per_step: list[int] = []
    dpa.use_symmetric_memory = rec
    set_state = dpa.set_dp_state_for_step

    def counting(*args: Any) -> None:
        per_step.append(len(rec.allocated))
        set_state(*args)

    dpa.set_dp_state_for_step = counting
    try:
        out = _greedy(model, vocab, dp_rank)
    finally:
        dpa.use_symmetric_memory, dpa.set_dp_state_for_step = real, set_state
    per_step.append(len(rec.allocated))
    out["pool_allocs"] = [b - a for a, b in itertools.pairwise(per_step)]
    return out


def _rank(
    rank: int, world: int, dsv4_path: str, kimi_ckpt: dict[str, torch.Tensor]
) -> dict[str, Any]:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers import dp_attention as dpa

    dp = 2
    ps.initialize_model_parallel(world, attention_dp_size=dp)
    dpa.set_dp_attention_config(True, dp_size=dp, attn_tp_size=world // dp)
    dp_rank = ps.get_attention_dp_rank()
    dsv4 = _load_dsv4(dsv4_path, rank, world)
    kimi = _load_kimi(kimi_ckpt, rank, world)
    heads = {m.attn.n_local_heads for m in dsv4.decoder_layers}
    return {
        "dp_rank": dp_rank,
        "dsv4": _run_recorded(dsv4, DSV4_CONFIG["vocab_size"], dp_rank),
        "kimi": _run_recorded(kimi, KIMI_CONFIG["vocab_size"], dp_rank),
        "dsv4_heads": heads,
        "kimi_kda_heads": kimi.attn_tp_size,
    }


def _check(world: int, tmp_path: Path) -> None:
    reference_model(DSV4_CONFIG, seed=21).save_pretrained(tmp_path)
    kimi_ckpt = export_checkpoint(make_model(KIMI_CONFIG, seed=22), mxfp4=False)
    want = {
        "dsv4": _greedy(_load_dsv4(str(tmp_path), 0, 1), DSV4_CONFIG["vocab_size"], None),
        "kimi": _greedy(_load_kimi(kimi_ckpt, 0, 1), KIMI_CONFIG["vocab_size"], None),
    }
    results = run_distributed(_rank, world, str(tmp_path), kimi_ckpt, timeout_s=300)
    attn_tp = world // 2
    assert [r["dp_rank"] for r in results] == [r // attn_tp for r in range(world)]
    for rank, got in enumerate(results):
        g = got["dp_rank"]
        assert got["dsv4_heads"] == {DSV4_CONFIG["num_attention_heads"] // attn_tp}
        assert got["kimi_kda_heads"] == attn_tp
        for name in ("dsv4", "kimi"):
            mine, ref = got[name], want[name]
            assert mine["tokens"][g] == ref["tokens"][g], (rank, name, mine["tokens"], ref)
            modes = [m for m, _ in mine["modes"]]
            # mixed prefills and the idle group's steps pack; balanced decodes pad to the max
            assert modes == ["sum_len"] + ["max_len"] * DECODES + ["sum_len"] * 2, modes
            for (mode, symmetric), pooled in zip(mine["modes"], mine["pool_allocs"]):
                assert symmetric == (mode == "max_len")
                # the gathered buffer and every MoE output go to the pool only when symmetric
                assert (pooled > 0) == symmetric, (rank, name, mode, pooled)
    for name in ("dsv4", "kimi"):
        # the tokens are not trivially constant
        assert len({t for grp in want[name]["tokens"] for row in grp for t in row}) > 2


def test_dp2_attention_tp1_greedy_tokens_equal_tp1(tmp_path: Path) -> None:
    _check(2, tmp_path)


def test_dp2_attention_tp2_greedy_tokens_equal_tp1(tmp_path: Path) -> None:
    _check(4, tmp_path)


if __name__ == "__main__":
    run_this_file(__file__)
