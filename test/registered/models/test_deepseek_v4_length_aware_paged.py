"""The length-aware decode kernels of DeepSeek V4 (``SGLANG_DSV4_LENGTH_AWARE_DECODE``) on the
paged slot pool, on CPU under the Triton interpreter (fp32; skipped where Triton is missing).

The GPU graph test failed only where slots are reused and batches padded, so this runs that case
small: CONFIG_A (ratios 0/4/128, window 8, top-4), blocks of 128 tokens and exactly the blocks
the batch needs, so each reused slot takes back its former owner's blocks (rows past the new
owner's length hold the old request's entries). The batch: slot 5 (was a 250-token request; now
126 -> 134, crossing the 128-token block edge: its ratio-4 entry 32, in its second block, appears
at 131), slot 3 (was 20 tokens; now 2 -> 10: the old ring rows past ``p``, then across the
window) and slot 4, padded to 4 rows with the scratch slot (6): slot ids exceed the batch size.
The null block is filled with a large value: the kernels read only live rows, the torch path
masks what it gathers.

Checked per layer on identical inputs (each layer runs the kernels and the torch path from the
same indexer state, and both must leave the same): the
kernels' attention output equals the torch path's to 1e-5 of its largest value (only summation
order differs, measured ~1e-7); end to end, the logits equal the eager decode on per-request
caches to 1e-4 of the largest |logit|, the other models' tolerance. The compressors' decode step
runs as its fused kernel here too (the interpreter runs Triton on CPU tensors), so the end-to-end
check covers it against the eager model. The interpreter's import
state is per process, so the scenario runs in a subprocess. First, on random rows, the kernels
through a shuffled block table equal them on the same rows stored per slot, bit for bit.
"""

from __future__ import annotations

import os
import sys

import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import run_under_interpreter
from sglang.test.run import run_this_file

register_cpu_ci(est_time=25)

LAYER_TOL = 1e-5
TOL = 1e-4
STEPS = 8  # the reused request 126 -> 134: its ratio-4 entry 32 (block 1) appears at 131
POISON = 1.0e4  # what the null block holds: a read of it would move the output by far more


def _paged_equals_unpaged() -> None:
    """The kernels on a block store through a shuffled table == on the same rows per slot."""
    from sglang.kernels.ops.attention.indexer_scores import indexer_scores
    from sglang.kernels.ops.attention.sparse_decode_attention import sparse_decode_attention

    g = torch.Generator().manual_seed(0)
    n_slots, width, d, rows, blocks, heads = 5, 8, 32, 4, 3, 4
    ring = torch.randn(n_slots, width, d, generator=g)
    per_slot = torch.randn(n_slots, blocks * rows, d, generator=g)
    table = torch.randperm(n_slots * blocks, generator=g).view(n_slots, blocks)
    store = torch.full((n_slots * blocks + 1, rows, d), POISON)  # + the null block
    store[table] = per_slot.view(n_slots, blocks, rows, d)
    slots, positions = torch.tensor([3, 0, 4]), torch.tensor([5, 30, 47])
    q, sink = torch.randn(3, heads, d, generator=g), torch.randn(heads, generator=g)
    picks = torch.stack([torch.randperm(blocks * rows, generator=g)[:5] for _ in range(3)])
    for ratio, chosen in ((4, picks), (4, None), (8, None)):
        kw = {"ratio": ratio, "picks": chosen}
        want = sparse_decode_attention(q, ring, slots, positions, sink, 0.2, entries=per_slot, **kw)
        got = sparse_decode_attention(
            q, ring, slots, positions, sink, 0.2, entries=store, table=table, **kw
        )
        assert torch.equal(got, want), (ratio, chosen is not None)
    w, visible = torch.rand(3, heads, generator=g), torch.tensor([2, 7, 12])
    want = indexer_scores(q, w, per_slot, slots, visible, 0.3)
    assert torch.equal(indexer_scores(q, w, store, slots, visible, 0.3, table=table), want)


def _scenario() -> None:
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention import dsv4_static_decode as sd
    from sglang.srt.mem_cache.deepseek_v4_slot_pool import LayerSlots
    from sglang.test.compressor_slot_state import run_from_same_state, slot_tensors
    from sglang.test.dsv4_tiny import CONFIG_A, our_model, reference_model, rel_err, token_ids

    vocab = CONFIG_A["vocab_size"]
    model = our_model(reference_model(CONFIG_A, seed=71))
    # Exactly the blocks of the batch: the reused slots can only get their former owners' blocks
    # back (2 for the long request, then its successor; 1 each for the others).
    pool = model.enable_slot_pool(6, 512, num_blocks=4, block_tokens=128)
    caches = [model.new_pooled_cache() for _ in range(6)]
    other, old_short, old_long = caches[4], caches[3], caches[5]
    model.prefill(token_ids(250, vocab, seed=72), old_long)
    model.prefill(token_ids(20, vocab, seed=75), old_short)
    for cache in (*caches[:3], old_short, old_long):  # freed last, taken first
        model.free_pooled_cache(cache)
    reused_long, reused_short = model.new_pooled_cache(), model.new_pooled_cache()
    assert (reused_long.slot, reused_short.slot, other.slot) == (5, 3, 4)
    # 126 -> 134 crosses the block edge at 128; 2 -> 10 starts with the old owner's ring rows
    # past p and crosses the window (8).
    lengths = (126, 2, 60)
    prompts = [token_ids(n + STEPS, vocab, seed=73 + i) for i, n in enumerate(lengths)]
    batch = [reused_long, reused_short, other]
    reference = [model.new_request_cache() for _ in batch]
    for ids, n, cache, ref in zip(prompts, lengths, batch, reference):
        model.prefill(ids[:n], cache)
        model.prefill(ids[:n], ref)
    for layer in pool.layers:
        for comp in (layer.compressor, layer.indexer):
            if comp is not None:
                comp.entries[pool.blocks.null_block] = POISON

    kernel, torch_path = sd._kernel_attention, sd._torch_attention
    worst_layer: list[float] = []

    def both(*args: object) -> torch.Tensor:
        # Both paths feed the indexer's compressor (a completed block moves its "previous" rows):
        # each starts from the same state and must leave the same.
        store: LayerSlots = args[5]  # type: ignore[assignment]
        got, want = run_from_same_state(
            slot_tensors(store.indexer),
            lambda: kernel(*args),  # type: ignore[arg-type]
            lambda: torch_path(*args),  # type: ignore[arg-type]
        )
        real = len(batch)  # padding rows' outputs are discarded
        err = (got[:real] - want[:real]).abs().max() / want[:real].abs().max()
        worst_layer.append(float(err))
        return got

    calls = []
    sd.use_sparse_kernels = lambda attn, ring: calls.append(1) or True  # fp32 pool, interpreter
    sd._kernel_attention = both
    worst = 0.0
    with envs.SGLANG_DSV4_LENGTH_AWARE_DECODE.override(True):
        for t in range(STEPS):
            ids = torch.stack([p[n + t] for p, n in zip(prompts, lengths)])
            got = model.decode_pooled(ids, batch, pad_to=4)
            want = model.decode(ids, reference)
            worst = max(worst, rel_err(got, want))
    assert calls and len(worst_layer) == len(calls), "the kernels must run"
    print(f"per layer kernels vs torch path: max {max(worst_layer):.2e}; logits {worst:.2e}")
    assert max(worst_layer) < LAYER_TOL, worst_layer
    assert worst < TOL
    print("LENGTH_AWARE_PAGED_OK")


def test_kernels_on_reused_slots_and_padding_rows_match_torch() -> None:
    # The top-k kernel too (off by default until its GPU run): it picks the stable sort's set.
    run_under_interpreter(
        marker="LENGTH_AWARE_PAGED_OK",
        argv=[os.path.abspath(__file__), "--scenario"],
        env={"SGLANG_DSV4_TOPK_KERNEL": "1"},
    )


if __name__ == "__main__":
    if "--scenario" in sys.argv:
        torch.set_num_threads(1)  # tiny tensors; the interpreter is the cost
        with torch.no_grad():
            _paged_equals_unpaged()
            _scenario()
    else:
        run_this_file(__file__)
