"""The graph tests' decode checks, shared by DeepSeek V4 and Kimi K3: from prompts of different
lengths, decode teacher-forced steps three ways (graph replay on pooled caches, the same static
decode eagerly at the padded size, the eager reference on per-request caches). Replay must equal
the eager static decode bit for bit (same kernels, same shapes); against the reference, where
only summation orders differ before bf16 rounding, the step errors must stay within
:func:`check_drift` and greedy tokens agree on >= 95% of the rows. ``routes`` (a
:class:`RouteFollower` on the model's MoE module) makes the reference follow the static path's
routing at router near-ties. And a slot a finished request leaves behind: replay on it, reused,
follows the reference within the same drift bound."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sglang.test.decode_drift import RouteFollower, check_drift, mean_rel


def check_replay_against_static_and_reference(
    model: Any,
    graphs: Any,
    seqs: Sequence[torch.Tensor],
    lengths: Sequence[int],
    steps: int,
    routes: RouteFollower | None = None,
) -> None:
    """``seqs[i]``: request i's prompt (its first ``lengths[i]`` ids) and forced next ids."""
    bs = len(seqs)
    replayed = [model.new_pooled_cache() for _ in range(bs)]
    static = [model.new_pooled_cache() for _ in range(bs)]
    reference = [model.new_request_cache() for _ in range(bs)]
    for seq, n, *caches in zip(seqs, lengths, replayed, static, reference):
        for cache in caches:
            model.prefill(seq[:n], cache)
    size = graphs.padded_size(bs)
    errs, agree = [], 0
    for t in range(steps):
        ids = torch.stack([seq[n + t] for seq, n in zip(seqs, lengths)])
        got = model.decode_pooled(ids, replayed, step=graphs.replay).clone()
        if routes is not None:
            routes.record()
        want = model.decode_pooled(ids, static, pad_to=size)
        assert torch.equal(got, want), (bs, t, float((got - want).abs().max()))
        if routes is not None:
            routes.follow()
        ref = model.decode(ids, reference)
        if routes is not None:
            routes.off()
        errs.append(mean_rel(got, ref))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
    followed = [f"{g:.1e}" for g in routes.gaps] if routes is not None else "not followed"
    print(
        f"bs {bs} (padded {size}): mean rel err vs reference worst {max(errs):.4f}, "
        f"median {sorted(errs)[len(errs) // 2]:.4f}, greedy agreement {agree}/{steps * bs}, "
        f"followed router flips (gaps) {followed}"
    )
    check_drift(errs, f"bs {bs}")
    assert agree >= 0.95 * steps * bs
    for cache in replayed + static:
        model.free_pooled_cache(cache)


def fill_and_free_slot(model: Any, graphs: Any, seq: torch.Tensor, prompt_len: int) -> None:
    """A request on a pooled slot: ``seq[:prompt_len]`` prefilled, the rest of ``seq`` decoded by
    graph replay, then freed (its rows stay in the slot for the next owner)."""
    cache = model.new_pooled_cache()
    model.prefill(seq[:prompt_len], cache)
    for t in range(prompt_len, len(seq)):
        model.decode_pooled(seq[t : t + 1], [cache], step=graphs.replay)
    model.free_pooled_cache(cache)


def check_reused_slot(
    model: Any, graphs: Any, reused: Any, fresh: Any, seq: torch.Tensor, start: int
) -> None:
    """``seq[start:]`` decoded by graph replay on the ``reused`` pooled cache against the eager
    reference on the ``fresh`` request cache (both prefilled with ``seq[:start]``): within
    :func:`check_drift`, so nothing the slot's former owner left is read."""
    errs = []
    for t in range(start, len(seq)):
        got = model.decode_pooled(seq[t : t + 1], [reused], step=graphs.replay)
        errs.append(mean_rel(got, model.decode(seq[t : t + 1], [fresh])))
    check_drift(errs, "reused slot")
