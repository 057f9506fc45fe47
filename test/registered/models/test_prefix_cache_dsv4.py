"""DeepSeek V4 through the prefix cache equals DeepSeek V4 without it (fp32, CPU, a tiny random
model: ratios 4 and 128 and a window-only layer, window 16, indexer top-8), served through the
model runner and the scheduler's policy (``sglang.test.prefix_cache_check``).

- The sweep: requests sharing 127 .. 257 tokens with an earlier one diverge just before, on and
  after every boundary: the block (128 tokens = the ratio-128 block), the window after the hit
  (128 + 16), a ratio-4 block inside the window (131), the pool block of 256 and the prompt's
  edge, with prefill chunks of 96 (chunk ends that are no block edges). Greedy tokens are equal
  and the sampled log-probs and logits differ only by fp32 summation order (< 1e-4); the hits
  land where the snapshots are (branch points, the prompt edge), snapshots are evicted by LRU
  (4 rows) and every block is back after /flush_cache.
- A conversation (two ratio-4 layers, blocks of 32 so decoding crosses edges): each turn resumes
  from the last edge of the previous turn's prompt and output (the snapshot saved while it
  decoded). Two continuations of the final prompt run side by side from the same prefix. With
  one request a step, the cache-on run is bit for bit the cache-off run that does the same
  forwards (``replay_cuts``): restoring blocks and snapshots is exact, the rest is summation
  order.
- Eviction: a pool of 10 blocks; unrelated requests push a cached prefix out (its next request
  misses), the one after hits again.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.prefix_cache_check import (
    Turn,
    check_against_cache_off,
    check_cache_on_vs_off,
    conversation_waves,
    make_server,
    random_ids,
    run_conversation_and_branches,
    run_waves,
    shared_prefix_waves,
    tiny_dsv4_checkpoint,
)
from sglang.test.run import run_this_file

register_cpu_ci(est_time=35)

VOCAB = 128
TOL = 1e-4  # fp32: summation order only (a wrong window row or entry is off by O(1))


@pytest.fixture(scope="module")
def ratio_128(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_dsv4_checkpoint(tmp_path_factory.mktemp("dsv4") / "r128")


@pytest.fixture(scope="module")
def ratio_4(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_dsv4_checkpoint(tmp_path_factory.mktemp("dsv4") / "r4", compress_ratios=[4, 4, 0])


def test_shared_prefix_sweep_around_every_boundary(ratio_128: str) -> None:
    torch.set_num_threads(1)
    base = random_ids(300, VOCAB, torch.Generator().manual_seed(0))
    shared = (127, 128, 129, 131, 143, 144, 145, 200, 255, 256, 257)
    waves = shared_prefix_waves(base, shared, VOCAB, seed=1)
    kw = {"page_size": 128, "max_total_tokens": 4096, "chunked_prefill_size": 96}
    on = make_server(ratio_128, radix=True, snapshots=4, **kw)
    got = run_waves(on, waves)
    want = run_waves(make_server(ratio_128, radix=False, **kw), waves)
    cached = check_cache_on_vs_off(got, want, TOL)
    # Nothing resumable before the first branch point; then the branch point (128) and the
    # prompt edge (256) where a snapshot was kept.
    assert cached["base"] == cached["s127"] == cached["s128"] == 0
    assert all(cached[f"s{s}"] >= 128 for s in shared if s > 128)
    assert cached["s257"] == 256
    tree, store = on.tree, on.runner.prefix_store
    assert tree is not None and store is not None
    assert tree.evicted_snapshots > 0 and tree.num_snapshots == 4  # the 4 rows, LRU-managed
    pool = on.runner.model.slot_pool  # type: ignore[attr-defined]
    blocks = pool.block_pool
    assert blocks.num_free + tree.num_blocks == blocks.num_blocks
    assert store.num_blocks == tree.num_blocks
    tree.flush()
    on.runner.execute(on.policy.next_step().plan)  # the flush's ops reach the rank
    assert blocks.num_free == blocks.num_blocks and store.snapshots.num_free == 4


def test_conversation_branches_and_bitwise_replay(ratio_4: str) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)
    first = random_ids(40, VOCAB, g)
    waves = conversation_waves(first, turns=4, message=20, max_new=12, vocab=VOCAB, seed=3)
    kw = {"page_size": 32, "max_total_tokens": 2048, "chunked_prefill_size": 512}
    on = make_server(ratio_4, radix=True, snapshots=8, **kw)
    got, branches = run_conversation_and_branches(on, waves, random_ids(9, VOCAB, g), [5], 32)
    check_against_cache_off(
        lambda: make_server(ratio_4, radix=False, **kw), waves, branches, got, TOL
    )


def test_an_evicted_prefix_misses_once_then_hits_again(ratio_4: str) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(4)
    prefix = random_ids(70, VOCAB, g)
    kw = {"page_size": 32, "max_total_tokens": 10 * 32, "chunked_prefill_size": 512}
    waves = [[Turn("x0", prefix + random_ids(5, VOCAB, g))]]
    waves += [[Turn(f"other{i}", random_ids(100, VOCAB, g))] for i in range(3)]
    waves += [[Turn("x1", prefix + random_ids(6, VOCAB, g))]]
    waves += [[Turn("x2", prefix + random_ids(7, VOCAB, g))]]
    on = make_server(ratio_4, radix=True, snapshots=4, **kw)
    got = run_waves(on, waves)
    tree = on.tree
    assert tree is not None and tree.evicted_blocks > 0
    assert got["x1"].cached_tokens == 0  # pushed out by the others
    assert got["x2"].cached_tokens == 64  # x1 cached it again
    want = run_waves(make_server(ratio_4, radix=False, **kw), waves)
    check_cache_on_vs_off(got, want, TOL)


def test_static_decode_and_mixed_steps_serve_cache_hits(
    ratio_4: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The static decode (padded to the graph sizes, as a replay runs it) and mixed steps (its
    decode rows beside eager prefill chunks of 16) with requests that resume mid-prompt."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    stem = random_ids(70, VOCAB, g)
    waves = [[Turn("seed", stem + random_ids(3, VOCAB, g), 3)]]
    waves += [
        [
            Turn("a", stem + random_ids(5, VOCAB, g), 8),
            Turn("b", stem + random_ids(40, VOCAB, g), 8),
            Turn("c", random_ids(50, VOCAB, g), 8),
        ]
    ]
    kw = {"page_size": 32, "max_total_tokens": 1024, "chunked_prefill_size": 16}
    on = make_server(ratio_4, radix=True, static_decode=True, **kw)
    mixed: list[int] = []  # the mixed steps, split into the static decode and an eager forward
    real = on.runner._execute_mixed
    monkeypatch.setattr(on.runner, "_execute_mixed", lambda *a: mixed.append(1) or real(*a))
    got = run_waves(on, waves)
    assert got["a"].cached_tokens == got["b"].cached_tokens == 64 and mixed
    want = run_waves(make_server(ratio_4, radix=False, static_decode=True, **kw), waves)
    check_cache_on_vs_off(got, want, TOL)  # on the static decode


def test_a_page_size_off_the_compress_ratios_is_refused_by_name(ratio_4: str) -> None:
    with pytest.raises(ValueError, match=r"--page-size 30: .*not a multiple of the compress"):
        make_server(ratio_4, radix=True, page_size=30, max_total_tokens=1024)


if __name__ == "__main__":
    run_this_file(__file__)
