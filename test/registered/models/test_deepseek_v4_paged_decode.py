"""The paged slot pool of DeepSeek V4: compressed entries and indexer keys in blocks of a shared
pool, read and written through each slot's block table, equal the unpaged per-request caches.

Fresh random weights (CONFIG_A: ratios 0/4/128, window 8), fp32 on CPU, blocks of 128 tokens
(the smallest multiple of ratio 128), a pool with exactly the blocks the batch needs. Covers:
static decode of a padded batch at lengths that cross the 128 and 256 block edges while decoding;
chunked eager prefill whose chunks span block edges; a freed request's slot and blocks reused
(the former owner's rows stay invisible); every block back after the requests finish; and a
reservation the pool cannot meet failing whole, leaving the pool as it was. Tolerance: 1e-4 of
the largest |logit| (only summation order differs).
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.block_pool import BlockPoolExhausted
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import CONFIG_A, our_model, reference_model, rel_err, token_ids
from sglang.test.pooled_decode_checks import prefill_eager_and_pooled, worst_pooled_vs_eager
from sglang.test.run import run_this_file

register_cpu_ci(est_time=25)

TOL = 1e-4
BLOCK = 128
CAPACITY = 512
LENGTHS, STEPS = (5, 122, 126, 250), 8  # crosses 128 (twice) and 256 while decoding
VOCAB = CONFIG_A["vocab_size"]


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


@pytest.fixture(scope="module")
def model() -> DeepseekV4ForCausalLM:
    m = our_model(reference_model(CONFIG_A, seed=31))
    need = sum(_blocks(n + STEPS) for n in LENGTHS)
    m.enable_slot_pool(len(LENGTHS), CAPACITY, num_blocks=need, block_tokens=BLOCK)
    return m


def test_paged_static_decode_equals_unpaged_then_reuse(model: DeepseekV4ForCausalLM) -> None:
    pool = model.slot_pool
    assert pool is not None
    blocks = pool.block_pool
    seqs = [token_ids(n + STEPS, VOCAB, seed=40 + i) for i, n in enumerate(LENGTHS)]
    eager, paged = prefill_eager_and_pooled(model, seqs, LENGTHS)
    assert blocks.num_free == blocks.num_blocks - sum(_blocks(n) for n in LENGTHS)
    pad_to = len(LENGTHS) + 2
    worst = worst_pooled_vs_eager(model, seqs, LENGTHS, STEPS, eager, paged, pad_to=pad_to)
    print(f"paged static vs unpaged eager decode, {STEPS} steps: rel max err {worst:.2e}")
    assert worst < TOL
    assert blocks.num_free == 0  # blocks were taken as decode crossed the edges, no more
    for e, p in zip(eager, paged):
        p.sync_layers()
        for le, lp in zip(e.layers, p.layers):
            for ce, cp in ((le.compressor, lp.compressor), (le.indexer, lp.indexer)):
                if ce is not None and cp is not None:
                    torch.testing.assert_close(cp.entries.rows(), ce.entries.rows())
    # The longest request finishes; a new one reuses its slot and blocks and must see none of
    # the former owner's rows (prefilled in chunks that span block edges, then decoded).
    slot, held = paged[3].slot, list(pool.blocks.blocks(paged[3].slot or 0).table)
    model.free_pooled_cache(paged[3])
    reused = model.new_pooled_cache()
    assert reused.slot == slot
    ids = token_ids(262, VOCAB, seed=50)
    full = model(ids, torch.arange(ids.shape[0]))
    out, start = [], 0
    for chunk in (100, 40, 115):
        out.append(model.prefill(ids[start : start + chunk], reused))
        start += chunk
    out += [model.decode_pooled(ids[t : t + 1], [reused], pad_to=2) for t in range(start, 262)]
    assert sorted(pool.blocks.blocks(reused.slot or 0).table) == sorted(held)
    err = rel_err(torch.cat(out), full)
    print(f"reused slot and blocks, chunked prefill + decode: rel max err {err:.2e}")
    assert err < TOL
    for cache in (*paged[:3], reused):
        model.free_pooled_cache(cache)
    assert blocks.num_free == blocks.num_blocks and pool.num_free == pool.max_slots  # no leak
    assert bool((pool.blocks.table == pool.blocks.null_block).all())


def test_reservation_the_pool_cannot_meet_fails_whole(model: DeepseekV4ForCausalLM) -> None:
    pool = model.slot_pool
    assert pool is not None
    blocks = pool.block_pool
    held = [model.new_pooled_cache() for _ in range(2)]
    model.prefill(token_ids(500, VOCAB, seed=60), held[0])  # 4 blocks
    model.prefill(token_ids(300, VOCAB, seed=61), held[1])  # 3 blocks: 1 of 8 left
    second = model.new_pooled_cache()
    free_before = blocks.num_free
    assert free_before == 1
    # Two blocks asked, one free: nothing is taken, the cache is untouched, the pool as it was.
    with pytest.raises(BlockPoolExhausted):
        model.prefill(token_ids(200, VOCAB, seed=62), second)
    assert blocks.num_free == free_before and len(second) == 0
    assert not pool.blocks.blocks(second.slot or 0).table
    first = held.pop(0)
    model.free_pooled_cache(first)
    ids = token_ids(20, VOCAB, seed=62)
    out = [model.prefill(ids[:12], second)]
    out += [model.decode_pooled(ids[t : t + 1], [second]) for t in range(12, 20)]
    assert rel_err(torch.cat(out), model(ids, torch.arange(20))) < TOL
    for cache in (second, *held):
        model.free_pooled_cache(cache)
    assert blocks.num_free == blocks.num_blocks


def test_block_tokens_must_be_a_multiple_of_every_ratio() -> None:
    m = our_model(reference_model(CONFIG_A, seed=32))
    with pytest.raises(ValueError, match="not a multiple of the compress ratios"):
        m.enable_slot_pool(1, 64, block_tokens=64)
    assert m.enable_slot_pool(1, 64).block_tokens == 256  # the default: lcm(4, 128) >= 256


if __name__ == "__main__":
    run_this_file(__file__)
