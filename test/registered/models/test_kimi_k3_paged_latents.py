"""Kimi K3's paged MLA latent cache (blocks of the slot pool shared by every request, read and
written through each request's block table; KDA states by slot, fixed-size) equals the unpaged
per-request cache on the eager forward.

Fresh random weights (tiny CONFIG_A: 8 layers, MLA at layers 4 and 8), fp32 on CPU, blocks of 8
tokens and a pool with exactly the blocks the batch needs. A batch of requests prefilled in chunks
that span block edges, then decoded across more edges, against per-request caches; the latents
match row for row. A finished request's row and blocks are reused (the former owner's rows stay
invisible: the new request matches a full forward), a reservation the pool cannot meet fails
whole, and every block is back at the end. Tolerance: 1e-4 of the largest |logit|.
Through the model runner and the scheduler's policy (a saved tiny checkpoint, the static decode's
gate closed): with --max-total-tokens the runner pages the latents in the slot pool and the policy
admits by blocks (2 requests at once where whole-context slots would run 1), logits equal the
unpaged runner's, no block leaks; without it caches stay per request and the startup line says
how to page them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.mem_cache.block_admission import slot_concurrency
from sglang.srt.mem_cache.block_pool import BlockPoolExhausted
from sglang.srt.mem_cache.kimi_k3_cache import MLALatentCache
from sglang.srt.mem_cache.paged_rows import PagedRows
from sglang.srt.model_executor.model_runner import DecodeSetup, ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.cpu_model_runner import cpu_model_runner, serve_on_both
from sglang.test.kimi_k3_tiny import CONFIG_A, CONFIG_B, make_model, tokens
from sglang.test.release_checkpoint import kimi_k3 as k3_release
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_max_err

register_cpu_ci(est_time=20)

TOL = 1e-4
BLOCK = 8
LENGTHS, STEPS = (3, 7, 15, 22), 5  # decoding crosses the 8, 16 and 24 edges


def test_paged_latents_equal_unpaged_with_reuse_and_no_leak() -> None:
    model = make_model(CONFIG_A, seed=71)
    need = sum(-(-(n + STEPS) // BLOCK) for n in LENGTHS)
    pool = model.enable_slot_pool(len(LENGTHS), 64, num_blocks=need, block_tokens=BLOCK)
    seqs = [tokens(n + STEPS, seed=80 + i) for i, n in enumerate(LENGTHS)]
    plain = [model.new_request_cache() for _ in LENGTHS]
    paged = [model.new_pooled_cache() for _ in LENGTHS]
    assert all(isinstance(layer, MLALatentCache) for layer in paged[0].layers[3::4])
    assert isinstance(paged[0].layers[3].rows, PagedRows)  # type: ignore[union-attr]
    for seq, n, a, b in zip(seqs, LENGTHS, plain, paged):
        model.prefill(seq[:n], a)
        half = n // 2 + 1  # two chunks, the second across a block edge for the longer ones
        model.prefill(seq[:half], b)
        model.prefill(seq[half:n], b)
    worst = 0.0
    for t in range(STEPS):
        ids = torch.stack([seq[n + t] for seq, n in zip(seqs, LENGTHS)])
        worst = max(worst, rel_max_err(model.decode(ids, paged), model.decode(ids, plain)))
    print(f"paged vs unpaged latents, {STEPS} decode steps: rel max err {worst:.2e}")
    assert worst < TOL and pool.block_pool.num_free == 0
    for a, b in zip(plain, paged):
        for la, lb in zip(a.layers, b.layers):
            if isinstance(la, MLALatentCache) and isinstance(lb, MLALatentCache):
                # chunked vs whole prefill: the later layers' inputs differ in summation order
                assert lb.rows.rows().shape == la.rows.rows().shape
                assert rel_max_err(lb.rows.rows(), la.rows.rows()) < TOL
    # The longest finishes (4 blocks back); a request that needs 5 fails whole and holds none.
    model.free_pooled_cache(paged[3])
    assert pool.block_pool.num_free == 4
    late = model.new_pooled_cache()
    with pytest.raises(BlockPoolExhausted):
        model.prefill(tokens(33, seed=90), late)
    assert pool.block_pool.num_free == 4 and len(late) == 0
    model.free_pooled_cache(late)
    for cache in paged[:3]:
        model.free_pooled_cache(cache)
    assert pool.block_pool.num_free == pool.block_pool.num_blocks
    assert bool((pool.blocks.table == pool.blocks.null_block).all())


def test_reused_row_and_blocks_hide_the_former_owner() -> None:
    model = make_model(CONFIG_A, seed=72)
    pool = model.enable_slot_pool(1, 64, num_blocks=3, block_tokens=BLOCK)
    first = model.new_pooled_cache()
    model.prefill(tokens(23, seed=91), first)
    held = list(pool.blocks.blocks(0).table)
    model.free_pooled_cache(first)
    ids = tokens(20, seed=92)
    full = model(ids, torch.arange(20))
    cache = model.new_pooled_cache()
    out = [model.prefill(ids[:5], cache)]
    out += [model.decode(ids[t : t + 1], [cache]) for t in range(5, 20)]
    assert cache.slot == 0 and sorted(pool.blocks.blocks(0).table) == sorted(held)
    assert rel_max_err(torch.cat(out), full) < TOL
    model.free_pooled_cache(cache)
    assert pool.block_pool.num_free == 3 and pool.num_free == 1


def _runner(path: Path, total: int | None) -> tuple[ModelRunner, DecodeSetup]:
    return cpu_model_runner(
        str(path),
        context_length=512,
        budget=total or 512 * 4,
        max_running_requests=4,
        max_total_tokens=total,
    )


def test_runner_pages_latents_and_admits_by_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_K3_STATIC_DECODE", "0")  # the eager decode on paged latents
    src = make_model(CONFIG_B, seed=73)
    k3_release.write_unquantised(tmp_path, CONFIG_B, src)
    paged, setup = _runner(tmp_path, 512)
    eager, plain = _runner(tmp_path, None)
    assert plain.block_tokens == 1 and not eager.pooled
    # On CPU the default budget is the worst case even with K3's memory model: not preallocated.
    assert plain.cuda_graph.endswith(
        "caches per request (set --max-total-tokens to page them: on cpu there is no GPU memory "
        "to measure)"
    )
    assert paged.pooled and paged.static_model is None
    assert "caches paged in 2 blocks of 256" in setup.cuda_graph
    assert (setup.block_tokens, setup.max_total_tokens) == (256, 512)
    policy = SchedulePolicy(
        max_running_requests=4, max_total_tokens=512, chunked_prefill_size=64, block_tokens=256
    )
    for i in range(4):
        policy.add(Req(f"r{i}", tokens(9 + i, seed=100 + i).tolist(), SamplingParams(), 6))
    run = serve_on_both(policy, paged, eager)
    assert slot_concurrency(512, 512, 4) == 1 and run.most_running == 2
    assert run.worst_rel_err < TOL
    pool = paged.model.slot_pool
    assert pool is not None and pool.block_pool.num_free == pool.block_pool.num_blocks
    assert pool.num_free == pool.max_slots
    assert not paged.caches


if __name__ == "__main__":
    run_this_file(__file__)
