"""Kimi K3 through the prefix cache equals Kimi K3 without it (fp32, CPU, the tiny CONFIG_A: KDA
and MLA layers, Attention Residuals in blocks of 3), served through the model runner and the
scheduler's policy (``sglang.test.prefix_cache_check``), blocks of 32 tokens.

A hit copies the KDA conv and recurrent states saved at the block edge it resumes from and
shares the MLA latents by block; the AttnRes bank is token-local (each row's own sub-layer
outputs), so the resumed prefill needs nothing else.

- The sweep: requests sharing 31 .. 100 tokens with an earlier one diverge just before, on and
  after a block edge (32, 64: also the KDA chunk of 64), the short conv's reach after the hit
  (32 + 3, 32 + 4) and mid-block, with prefill chunks of 48 (chunk ends that are no block
  edges): greedy tokens equal, log-probs and logits within fp32 summation order (< 5e-4).
- A conversation: each turn resumes at the last edge of the previous prompt and output; two
  continuations of the final prompt run side by side; with one request a step the cache-on run
  is bit for bit the cache-off run doing the same forwards.
- Eviction: unrelated requests push a cached prefix out of an 8-block pool (its next request
  misses), the one after hits again.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.kimi_k3_tiny import CONFIG_A, VOCAB, make_model
from sglang.test.prefix_cache_check import (
    Turn,
    check_against_cache_off,
    check_cache_on_vs_off,
    conversation_waves,
    fixed_prompts,
    make_server,
    random_ids,
    run_conversation_and_branches,
    run_waves,
    shared_prefix_waves,
)
from sglang.test.release_checkpoint import kimi_k3 as k3_release
from sglang.test.run import run_this_file

register_cpu_ci(est_time=40)

# fp32: summation order only, which the KDA recurrence and the random layers after it amplify to
# ~1e-4 (measured 6e-5 .. 9.5e-5; chunked prefill without the cache differs as much); a wrong
# state or latent is off by O(1). The bit-for-bit replay below is the exact check.
TOL = 5e-4
KW = {"page_size": 32, "max_total_tokens": 2048}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("k3")
    src = make_model(CONFIG_A, seed=31)
    k3_release.write_unquantised(path, CONFIG_A, src)
    return str(path)


def test_shared_prefix_sweep_around_every_boundary(checkpoint: str) -> None:
    torch.set_num_threads(1)
    base = random_ids(130, VOCAB, torch.Generator().manual_seed(0), low=0)
    shared = (31, 32, 33, 35, 36, 63, 64, 65, 100)
    waves = shared_prefix_waves(base, shared, VOCAB, seed=1)
    on = make_server(checkpoint, radix=True, snapshots=6, chunked_prefill_size=48, **KW)
    got = run_waves(on, waves)
    off = make_server(checkpoint, radix=False, chunked_prefill_size=48, **KW)
    want = run_waves(off, fixed_prompts(waves, got))
    cached = check_cache_on_vs_off(got, want, TOL)
    assert cached["base"] == cached["s31"] == cached["s32"] == 0
    assert all(cached[f"s{s}"] >= 32 for s in shared if s > 32)
    assert cached["s65"] >= 64 and cached["s100"] >= 64
    tree = on.tree
    assert tree is not None and tree.num_snapshots <= 6
    # Every snapshot is a slot's KDA states, as the memory model budgets it.
    store = on.runner.prefix_store
    model = on.runner.model
    assert store is not None
    assert store.snapshots.row_bytes() == model.memory_model().snapshot_bytes()  # type: ignore[attr-defined]


def test_conversation_branches_and_bitwise_replay(checkpoint: str) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)
    first = random_ids(40, VOCAB, g, low=0)
    waves = conversation_waves(first, turns=4, message=15, max_new=12, vocab=VOCAB, seed=3)
    on = make_server(checkpoint, radix=True, snapshots=8, chunked_prefill_size=512, **KW)
    left = random_ids(9, VOCAB, g, low=0)
    got, branches = run_conversation_and_branches(on, waves, left, [], 32)
    check_against_cache_off(
        lambda: make_server(checkpoint, radix=False, chunked_prefill_size=512, **KW),
        waves,
        branches,
        got,
        TOL,
    )


def test_an_evicted_prefix_misses_once_then_hits_again(checkpoint: str) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(4)
    prefix = random_ids(70, VOCAB, g, low=0)
    kw = {"page_size": 32, "max_total_tokens": 8 * 32, "chunked_prefill_size": 512}
    waves = [[Turn("x0", prefix + random_ids(5, VOCAB, g, low=0))]]
    waves += [[Turn(f"other{i}", random_ids(70, VOCAB, g, low=0))] for i in range(3)]
    waves += [[Turn("x1", prefix + random_ids(6, VOCAB, g, low=0))]]
    waves += [[Turn("x2", prefix + random_ids(7, VOCAB, g, low=0))]]
    on = make_server(checkpoint, radix=True, snapshots=4, **kw)
    got = run_waves(on, waves)
    tree = on.tree
    assert tree is not None and tree.evicted_blocks > 0
    assert got["x1"].cached_tokens == 0 and got["x2"].cached_tokens == 64
    want = run_waves(make_server(checkpoint, radix=False, **kw), waves)
    check_cache_on_vs_off(got, want, TOL)


if __name__ == "__main__":
    run_this_file(__file__)
