"""Incremental decoding of DeepSeek V4 with per-request caches (window ring, compressed entries,
the compressors' partial blocks and overlap rows, the indexer's keys) equals the full-sequence
forward: prefill then token-by-token decode, uneven chunked prefill, and a batch of requests of
different lengths against each request alone. Lengths cross the window (8 / 16) and the ratio-4
and ratio-128 block boundaries. fp32; tolerance 1e-4 relative to the largest logit (only the
summation order differs)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.growable_rows import GrowableRows
from sglang.srt.mem_cache.window_ring import WindowRing
from sglang.srt.models.deepseek_v4 import DeepseekV4Batch, DeepseekV4ForCausalLM
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import CONFIG_A, CONFIG_B, our_model, reference_model, rel_err, token_ids
from sglang.test.run import run_this_file

register_cpu_ci(est_time=40)

TOL = 1e-4


@pytest.fixture(scope="module")
def model_a() -> DeepseekV4ForCausalLM:
    return our_model(reference_model(CONFIG_A, seed=8))


@pytest.fixture(scope="module")
def model_b() -> DeepseekV4ForCausalLM:
    return our_model(reference_model(CONFIG_B, seed=9))


def _full(model: DeepseekV4ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, torch.arange(ids.shape[0]))


def test_prefill_then_decode_matches_full_sequence(model_a: DeepseekV4ForCausalLM) -> None:
    n = 262
    ids = token_ids(n, CONFIG_A["vocab_size"], seed=1)
    full = _full(model_a, ids)
    # Decode across 128 (the first ratio-128 block) from one prefill, across 256 from another;
    # both decode across many ratio-4 blocks and the window.
    for prefill, stop in ((121, 135), (249, n)):
        cache = model_a.new_request_cache()
        out = [model_a.prefill(ids[:prefill], cache)]
        out += [model_a.decode(ids[t : t + 1], [cache]) for t in range(prefill, stop)]
        err = rel_err(torch.cat(out), full[:stop])
        print(f"prefill {prefill} + decode to {stop}: rel max err {err:.2e}")
        assert len(cache) == stop and err < TOL
    layer2 = cache.layers[2]  # ratio 128: two entries, 6 tokens pending
    assert layer2.compressor is not None and layer2.compressor.num_entries == 2
    assert layer2.compressor.pending_kv.shape[0] == n - 256
    assert len(layer2.window) == CONFIG_A["sliding_window"] - 1


@pytest.mark.parametrize("chunks", [(1, 6, 50, 3, 77, 130), (129, 2, 4, 135)])
def test_uneven_chunked_prefill_matches_full_sequence(
    model_a: DeepseekV4ForCausalLM, chunks: tuple[int, ...]
) -> None:
    ids = token_ids(sum(chunks), CONFIG_A["vocab_size"], seed=2)
    full = _full(model_a, ids)
    cache = model_a.new_request_cache()
    out, start = [], 0
    for c in chunks:
        out.append(model_a.prefill(ids[start : start + c], cache))
        start += c
    assert rel_err(torch.cat(out), full) < TOL


def test_batch_of_different_lengths_equals_each_alone(model_b: DeepseekV4ForCausalLM) -> None:
    lengths, steps = (37, 150, 5), 12
    vocab = CONFIG_B["vocab_size"]
    seqs = [token_ids(n + steps, vocab, seed=10 + i) for i, n in enumerate(lengths)]
    alone = [_full(model_b, s) for s in seqs]

    caches = [model_b.new_request_cache() for _ in lengths]
    ids = torch.cat([s[:n] for s, n in zip(seqs, lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    logits = model_b(ids, positions, DeepseekV4Batch(lengths, caches))
    for r, part in enumerate(logits.split(list(lengths))):
        assert rel_err(part, alone[r][: lengths[r]]) < TOL, f"request {r} prefill"

    for step in range(steps):
        tokens = torch.stack([s[n + step] for s, n in zip(seqs, lengths)])
        out = model_b.decode(tokens, caches)
        for r in range(len(lengths)):
            assert rel_err(out[r], alone[r][lengths[r] + step]) < TOL, (
                f"request {r} decode step {step}"
            )


def test_mixed_prefill_and_decode_batch(model_b: DeepseekV4ForCausalLM) -> None:
    """One forward holding a decode row of one request and a prefill chunk of another."""
    vocab = CONFIG_B["vocab_size"]
    a, b = token_ids(40, vocab, seed=20), token_ids(70, vocab, seed=21)
    full_a, full_b = _full(model_b, a), _full(model_b, b)
    ca, cb = model_b.new_request_cache(), model_b.new_request_cache()
    model_b.prefill(a[:39], ca)
    model_b.prefill(b[:30], cb)
    ids = torch.cat([a[39:40], b[30:70]])
    positions = torch.cat([torch.tensor([39]), torch.arange(30, 70)])
    out = model_b(ids, positions, DeepseekV4Batch([1, 40], [ca, cb]))
    assert rel_err(out[:1], full_a[39:40]) < TOL
    assert rel_err(out[1:], full_b[30:70]) < TOL


def test_positions_must_continue_the_cache(model_b: DeepseekV4ForCausalLM) -> None:
    cache = model_b.new_request_cache()
    model_b.prefill(token_ids(5, CONFIG_B["vocab_size"]), cache)
    with pytest.raises(ValueError, match="continue its cache"):
        model_b(torch.tensor([1, 2]), torch.tensor([6, 7]), DeepseekV4Batch([2], [cache]))


def test_window_ring_keeps_the_last_rows_in_position_order() -> None:
    ring = WindowRing(5, 2, dtype=torch.float32)
    for n in (3, 1, 7, 2, 0, 4, 5, 6):
        start = ring.total
        ring.append(torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, 2))
        want = list(range(max(0, ring.total - 5), ring.total))
        assert ring.rows()[:, 0].tolist() == want
        assert ring.first_position == (want[0] if want else 0)


def test_growable_rows_append() -> None:
    rows = GrowableRows(3, dtype=torch.float32, capacity=2)
    chunks = [torch.randn(n, 3) for n in (1, 0, 5, 2, 17)]
    for c in chunks:
        rows.append(c)
    assert len(rows) == 25 and torch.equal(rows.rows(), torch.cat(chunks))


if __name__ == "__main__":
    run_this_file(__file__)
