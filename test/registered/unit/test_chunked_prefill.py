"""The test kit's chunked prefill (``sglang.test.chunked_prefill``), through a model that records
its forwards: each forward takes the next chunk of every unfinished prompt at the right
positions, a finished prompt leaves the batch, and each prompt's logits rows come back in order."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang.test.chunked_prefill import chunked_prefill
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=2)


class RecordingModel:
    """Logits rows ``[token, position, cache]`` per input token; records each forward."""

    def __init__(self) -> None:
        self.forwards: list[tuple[list[int], list[Any]]] = []

    def batch_type(self, lens: list[int], caches: list[Any]) -> tuple[list[int], list[Any]]:
        return lens, caches

    def __call__(
        self, ids: torch.Tensor, pos: torch.Tensor, batch: tuple[list[int], list[Any]]
    ) -> torch.Tensor:
        lens, caches = batch
        self.forwards.append((lens, caches))
        owner = torch.cat([torch.full((n,), c) for n, c in zip(lens, caches)])
        return torch.stack([ids.float(), pos.float(), owner.float()], dim=1)


@pytest.mark.parametrize("chunk", [None, 1, 3, 8])
def test_chunks_positions_and_rows(chunk: int | None) -> None:
    g = torch.Generator().manual_seed(chunk or 0)
    prompts = [torch.randint(0, 1000, (n,), generator=g) for n in (5, 2, 7)]
    caches = [10, 11, 12]
    model = RecordingModel()
    rows = chunked_prefill(model, prompts, caches, chunk, device="cpu")
    step = chunk or 7
    want_forwards = []
    for k in range(-(-7 // step)):
        live = [i for i, p in enumerate(prompts) if k * step < len(p)]
        lens = [min(step, len(prompts[i]) - k * step) for i in live]
        want_forwards.append((lens, [caches[i] for i in live]))
    assert model.forwards == want_forwards
    for prompt, cache, got in zip(prompts, caches, rows):
        got = torch.cat(got)
        assert torch.equal(got[:, 0], prompt.float())
        assert torch.equal(got[:, 1], torch.arange(len(prompt)).float())
        assert (got[:, 2] == cache).all()


if __name__ == "__main__":
    run_this_file(__file__)
