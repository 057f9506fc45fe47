"""The static decode of DeepSeek V4 (slot pool, fixed shapes, no host sync: what the decode CUDA
graphs capture) equals the eager decode on per-request caches, in fp32 on CPU.

Covers a batch of requests at different lengths padded with scratch rows, decoding across the
sliding window (16) and the ratio-4 and ratio-128 block boundaries; chunked prefill into the
pool's storage followed by static decode (and eager steps after static ones: the host counts stay
right); slot reuse after free. Tolerance: 1e-4 of the largest |logit| (the eager reference's
own tolerance against a full-sequence forward; only summation order differs, measured ~1e-6).
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.slot_blocks import SlotPoolFullError
from sglang.srt.models.deepseek_v4 import DeepseekV4Batch, DeepseekV4ForCausalLM
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import CONFIG_A, CONFIG_B, our_model, reference_model, rel_err, token_ids
from sglang.test.pooled_decode_checks import (
    check_decode_pooled_refusals,
    prefill_eager_and_pooled,
    worst_pooled_vs_eager,
)
from sglang.test.run import run_this_file

register_cpu_ci(est_time=40)

TOL = 1e-4
CAPACITY = 300


@pytest.fixture(scope="module")
def model_b() -> DeepseekV4ForCausalLM:
    model = our_model(reference_model(CONFIG_B, seed=9))
    model.enable_slot_pool(max_slots=6, capacity=CAPACITY)
    return model


@pytest.fixture(scope="module")
def model_a() -> DeepseekV4ForCausalLM:
    model = our_model(reference_model(CONFIG_A, seed=8))
    model.enable_slot_pool(max_slots=2, capacity=CAPACITY)
    return model


def test_padded_batch_static_equals_eager(model_b: DeepseekV4ForCausalLM) -> None:
    # Decoding from these lengths crosses 16 (window), 128 and 256 (ratio 128), and many
    # ratio-4 blocks; the shortest starts before the first block completes.
    lengths, steps = (3, 14, 124, 252), 10
    vocab = CONFIG_B["vocab_size"]
    seqs = [token_ids(n + steps + 1, vocab, seed=20 + i) for i, n in enumerate(lengths)]
    eager, pooled = prefill_eager_and_pooled(model_b, seqs, lengths)
    pad_to = len(lengths) + 3
    worst = worst_pooled_vs_eager(model_b, seqs, lengths, steps, eager, pooled, pad_to=pad_to)
    print(f"static vs eager decode, {steps} steps: rel max err {worst:.2e}")
    assert worst < TOL
    # An eager step after static ones continues the same storage (host counts in sync).
    ids = torch.stack([seq[n + steps] for seq, n in zip(seqs, lengths)])
    assert rel_err(model_b.decode(ids, pooled), model_b.decode(ids, eager)) < TOL
    for e, p in zip(eager, pooled):
        assert len(e) == len(p)
        for le, lp in zip(e.layers, p.layers):
            assert lp.window.total == le.window.total
            for ce, cp in ((le.compressor, lp.compressor), (le.indexer, lp.indexer)):
                if ce is not None and cp is not None:
                    assert cp.num_entries == ce.num_entries
                    assert cp.num_pending == ce.num_pending
                    torch.testing.assert_close(cp.entries.rows(), ce.entries.rows())
        model_b.free_pooled_cache(p)


def test_padding_rows_never_touch_real_slots(model_b: DeepseekV4ForCausalLM) -> None:
    pool = model_b.slot_pool
    assert pool is not None
    cache = model_b.new_pooled_cache()
    model_b.prefill(token_ids(9, CONFIG_B["vocab_size"], seed=3), cache)
    others = [s for s in range(pool.max_slots) if s != cache.slot]
    before = [layer.window[others].clone() for layer in pool.layers]
    model_b.decode_pooled(torch.tensor([5]), [cache], pad_to=8)
    for layer, snap in zip(pool.layers, before):
        assert torch.equal(layer.window[others], snap)
    model_b.free_pooled_cache(cache)


@pytest.mark.parametrize("chunks", [(1, 6, 50, 3, 77), (129, 2, 4)])
def test_chunked_prefill_into_pool_then_static_decode(
    model_a: DeepseekV4ForCausalLM, chunks: tuple[int, ...]
) -> None:
    steps = 12
    n = sum(chunks)
    ids = token_ids(n + steps, CONFIG_A["vocab_size"], seed=4)
    full = model_a(ids, torch.arange(ids.shape[0]))
    cache = model_a.new_pooled_cache()
    out, start = [], 0
    for c in chunks:
        out.append(model_a.prefill(ids[start : start + c], cache))
        start += c
    out += [model_a.decode_pooled(ids[t : t + 1], [cache]) for t in range(n, n + steps)]
    err = rel_err(torch.cat(out), full)
    print(f"chunks {chunks} + {steps} static steps: rel max err {err:.2e}")
    assert err < TOL
    model_a.free_pooled_cache(cache)


def test_slot_reuse_after_free(model_a: DeepseekV4ForCausalLM) -> None:
    pool = model_a.slot_pool
    assert pool is not None
    vocab = CONFIG_A["vocab_size"]
    first = model_a.new_pooled_cache()
    other = model_a.new_pooled_cache()
    with pytest.raises(SlotPoolFullError):
        model_a.new_pooled_cache()
    long_ids = token_ids(140, vocab, seed=5)
    model_a.prefill(long_ids[:130], first)
    for t in range(130, 140):
        model_a.decode_pooled(long_ids[t : t + 1], [first])
    slot = first.slot
    model_a.free_pooled_cache(first)
    reused = model_a.new_pooled_cache()
    assert reused.slot == slot and pool.num_free == 0
    # The former owner's rows are still in the slot; the new request must not see them.
    ids = token_ids(20, vocab, seed=6)
    full = model_a(ids, torch.arange(20))
    out = [model_a.prefill(ids[:2], reused)]
    out += [model_a.decode_pooled(ids[t : t + 1], [reused]) for t in range(2, 20)]
    assert rel_err(torch.cat(out), full) < TOL
    for cache in (reused, other):
        model_a.free_pooled_cache(cache)
    assert pool.num_free == pool.max_slots


def test_static_decode_rejects_unpooled_and_full_caches(model_a: DeepseekV4ForCausalLM) -> None:
    check_decode_pooled_refusals(model_a, CAPACITY)
    batch = DeepseekV4Batch([1], [model_a.new_request_cache()])
    assert model_a(torch.tensor([1]), torch.tensor([0]), batch).shape[0] == 1


if __name__ == "__main__":
    run_this_file(__file__)
