"""Prefill of several prompts in shared forwards, a chunk of each at a time: every forward takes
the next chunk (``chunk`` tokens, or the whole rest when ``None``) of every unfinished prompt, so
the batch mixes prompts at different offsets and drops a prompt once it is done."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def chunked_prefill(
    model: Any,
    prompts: Sequence[torch.Tensor],
    caches: Sequence[Any],
    chunk: int | None,
    device: torch.device | str | None = None,
) -> list[list[torch.Tensor]]:
    """Run the prefill of ``prompts`` into their ``caches`` through ``model(ids, positions,
    model.batch_type(lens, caches))``; -> the logits rows of each prompt, one tensor a forward
    (ids and positions moved to ``device`` when given)."""
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        live = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        lens = [min(chunk or len(prompts[i]), len(prompts[i]) - done[i]) for i in live]
        ids = torch.cat([prompts[i][done[i] : done[i] + n] for i, n in zip(live, lens)])
        pos = torch.cat([torch.arange(done[i], done[i] + n) for i, n in zip(live, lens)])
        if device is not None:
            ids, pos = ids.to(device), pos.to(device)
        logits = model(ids, pos, model.batch_type(lens, [caches[i] for i in live]))
        start = 0
        for i, n in zip(live, lens):
            rows[i].append(logits[start : start + n])
            done[i] += n
            start += n
    return rows
