"""Logits of only some rows (``forward(..., logit_rows=...)``) equal those rows of the full
logits, on tiny random DeepSeek V4 and Kimi K3 models (with and without AttnRes): a batch of
requests of different lengths on fresh caches, each row set run on its own copy of the caches.
The rows are dropped before the final mHC head / AttnRes read, norm and LM head, which are per
token, so only the GEMMs' row count changes, and with it the BLAS blocking: measured at most
3.5e-7 of the largest |logit| on CPU (fp32 rounding); a wrong or dropped row is O(1). The caches
must come out the same too (the second step's logits compare)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang.srt.models.cached_lm import CachedCausalLM
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import CONFIG_A as DSV4_A
from sglang.test.dsv4_tiny import our_model, reference_model
from sglang.test.kimi_k3_tiny import CONFIG_A as K3_A
from sglang.test.kimi_k3_tiny import CONFIG_C as K3_C
from sglang.test.kimi_k3_tiny import make_model
from sglang.test.run import run_this_file

register_cpu_ci(est_time=6)

LENS = (5, 1, 9)  # a prefill chunk, a decode-sized row, another chunk
ROW_SETS = {
    "last of each": [4, 5, 14],
    "one": [14],
    "logprob rows + last": [0, 1, 2, 3, 4, 5, 14],
}


def _model(name: str) -> CachedCausalLM[Any]:
    if name == "dsv4":
        return our_model(reference_model(DSV4_A))
    return make_model(K3_A if name == "k3-attnres" else K3_C)


MODELS = ("dsv4", "k3-attnres", "k3-plain")


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest) -> CachedCausalLM[Any]:
    return _model(request.param)


def _step(
    model: CachedCausalLM[Any], caches: list[Any], ids: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    positions = torch.cat([torch.arange(len(c), len(c) + n) for c, n in zip(caches, LENS)])
    batch = model.batch_type(list(LENS), caches)
    return model.forward(ids, positions, batch, logit_rows=rows)


def test_logit_rows_equal_full_logits(model: CachedCausalLM[Any]) -> None:
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, vocab, (sum(LENS),), generator=g) for _ in range(2)]
    full_caches = [model.new_request_cache() for _ in LENS]
    part_caches = {name: [model.new_request_cache() for _ in LENS] for name in ROW_SETS}
    for step_ids in ids:  # the second step continues the caches the first one wrote
        full = _step(model, full_caches, step_ids, None)
        for name, row_list in ROW_SETS.items():
            rows = torch.tensor(row_list, dtype=torch.long)
            part = _step(model, part_caches[name], step_ids, rows)
            want = full.index_select(0, rows)
            assert part.shape == (len(rows), vocab) and part.dtype == torch.float32
            err = float((part - want).abs().max() / want.abs().max())
            assert err <= 1e-6, f"{name}: rel err {err:.2e}"
    for caches in part_caches.values():
        assert [len(c) for c in caches] == [2 * n for n in LENS]


def test_no_rows_and_bad_rows(model: CachedCausalLM[Any]) -> None:
    vocab = int(model.config.vocab_size)
    caches = [model.new_request_cache() for _ in LENS]
    ids = torch.randint(0, vocab, (sum(LENS),), generator=torch.Generator().manual_seed(2))
    empty = _step(model, caches, ids, torch.empty(0, dtype=torch.long))
    assert empty.shape == (0, vocab) and [len(c) for c in caches] == list(LENS)
    with pytest.raises(ValueError, match="1-D int64"):
        _step(model, [model.new_request_cache() for _ in LENS], ids, torch.tensor([1.0]))


if __name__ == "__main__":
    run_this_file(__file__)
