"""The per-rank side of the DP-attention parity tests: the step schedule, the greedy run under the
step's DP state (or TP=1), and the model loaders. Its imports stay light (no transformers): every
spawned rank imports this module."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.test.moe_placement import moe_held

# Prompt lengths of group 0 and group 1 (requests balanced 2 + 2), then group 1's late prompt.
GROUPS = ((9, 17), (1, 4))
LATE = 6
DECODES = 3


def _prompts(vocab: int) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    groups = [[torch.randint(0, vocab, (n,), generator=gen) for n in g] for g in GROUPS]
    return groups, torch.randint(0, vocab, (LATE,), generator=gen)


def _forward(model: Any, rows: list[torch.Tensor], caches: list[Any]) -> torch.Tensor:
    """One forward of ``rows[i]`` appended to ``caches[i]``; each request's last logits row (the
    forward computes only those, as the runner asks it to)."""
    ids = torch.cat(rows)
    pos = torch.cat([torch.arange(len(c), len(c) + r.shape[0]) for r, c in zip(rows, caches)])
    last = torch.cumsum(torch.tensor([r.shape[0] for r in rows]), 0) - 1
    batch = model.batch_type([r.shape[0] for r in rows], caches)
    return model(ids, pos, batch, logit_rows=last)


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
def greedy(model: Any, vocab: int, dp_rank: int | None) -> dict[str, Any]:
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


def _spec(rank: int, world: int, ep_size: int | None) -> LayerBuildSpec:
    """fp32, torch runner; ``ep_size`` set: the ``ep`` a2a backend (experts over ``ep_size``
    ranks), else the experts tensor-parallel over every rank."""
    return LayerBuildSpec(
        dtype=torch.float32,
        tp_rank=rank,
        tp_size=world,
        moe_runner="torch",
        a2a_backend="none" if ep_size is None else "ep",
        moe_ep_size=ep_size,
    )


def load_dsv4(path: str, rank: int, world: int, ep_size: int | None = None) -> Any:
    from sglang.srt.models.loading import load_model

    return load_model(path, _spec(rank, world, ep_size), LoadOptions(progress=False))


def load_kimi(
    raw: dict[str, Any],
    ckpt: dict[str, torch.Tensor],
    rank: int,
    world: int,
    ep_size: int | None = None,
) -> Any:
    from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
    from sglang.srt.models.kimi_k3_config import KimiK3Config
    from sglang.srt.models.loading import load_weights

    model = KimiK3ForCausalLM(KimiK3Config.from_dict(raw), _spec(rank, world, ep_size))
    load_weights(model, ckpt, LoadOptions(progress=False))
    return model


def _run_recorded(model: Any, vocab: int, dp_rank: int) -> dict[str, Any]:
    """:func:`greedy` with the recording fake in place of the pool: per step, how many storages
    were created in enabled (pool) scopes."""
    from sglang.srt.distributed.symm_mem import output_scope
    from sglang.srt.layers import dp_attention as dpa
    from sglang.test.alloc_recorder import SymmetricScopeRecorder

    real = output_scope.use_symmetric_memory
    rec = SymmetricScopeRecorder()
    per_step: list[int] = []
    output_scope.use_symmetric_memory = rec
    set_state = dpa.set_dp_state_for_step

    def counting(*args: Any) -> None:
        per_step.append(len(rec.allocated))
        set_state(*args)

    dpa.set_dp_state_for_step = counting
    try:
        out = greedy(model, vocab, dp_rank)
    finally:
        output_scope.use_symmetric_memory, dpa.set_dp_state_for_step = real, set_state
    per_step.append(len(rec.allocated))
    out["pool_allocs"] = [b - a for a, b in itertools.pairwise(per_step)]
    return out


def run_rank(
    rank: int,
    world: int,
    dsv4_path: str,
    dsv4_vocab: int,
    kimi_raw: dict[str, Any],
    kimi_ckpt: dict[str, torch.Tensor],
    ep_size: int | None = None,
) -> dict[str, Any]:
    """One rank of TP=``world``, DP=2 (and EP=``ep_size`` when set): both models loaded at this
    rank's place, each run through the schedule with the recording fake."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers import dp_attention as dpa

    torch.set_num_threads(1)  # several ranks share the CPU cores
    dp = 2
    ps.initialize_model_parallel(world, attention_dp_size=dp)
    dpa.set_dp_attention_config(True, dp_size=dp, attn_tp_size=world // dp)
    dp_rank = ps.get_attention_dp_rank()
    dsv4 = load_dsv4(dsv4_path, rank, world, ep_size)
    kimi = load_kimi(kimi_raw, kimi_ckpt, rank, world, ep_size)
    return {
        "dp_rank": dp_rank,
        "dsv4": _run_recorded(dsv4, dsv4_vocab, dp_rank),
        "kimi": _run_recorded(kimi, kimi_raw["vocab_size"], dp_rank),
        "held": (moe_held(dsv4), moe_held(kimi)),
        "dsv4_heads": {m.attn.n_local_heads for m in dsv4.decoder_layers},
        # KDA and MLA heads of this rank (the config has as many of each)
        "kimi_heads": {layer.self_attn.local_heads for layer in kimi.decoder_layers},
        # the attention output projections this rank loaded (its attention-TP slice)
        "attn_weights": [
            dsv4.decoder_layers[0].attn.wo_b.weight.clone(),
            *(layer.self_attn.o_proj.weight.clone() for layer in kimi.decoder_layers),
        ],
    }
