"""Kimi K3's static decode (slot pool: KDA states by slot, MLA latents paged; fixed shapes, no host
sync: what the decode CUDA graphs would capture) equals the eager decode on per-request caches, in
fp32 on CPU (tiny CONFIG_A: AttnRes blocks of 3, MLA at layers 4 and 8; CONFIG_C: plain residuals).

- A batch of prompts of different lengths (1 to 21 tokens), padded with scratch rows, decoded over
  block edges (blocks of 8): logits, KDA states and latents equal the eager path's; an eager step
  after static ones continues the same storage; a pooled request outside the batch and the free
  slots are untouched by the padding rows.
- A freed slot taken by a short request: it sees none of the former owner's states or latents
  (equal to a full forward of its own tokens).
- The gate, at the model-runner level (a saved tiny checkpoint): with SGLANG_K3_STATIC_DECODE off
  serving K3 decodes eagerly (paged latents, the reason in the startup line), also without
  --max-total-tokens; on, the runner takes the static decode and its logits equal the eager
  runner's over mixed prefill / decode plans with frees and slot reuse.
- Without --max-total-tokens: on CPU the default budget is the worst case, so neither the slot
  pool nor the paged latents are preallocated (the reason says why); where the budget is measured
  with K3's memory model (a CUDA device) the static decode needs no --max-total-tokens when the
  gate is on, the eager path pages its latents, and a paged model without a memory model still
  needs the flag.
Tolerance: 2e-5 of the largest |logit| against the eager decode (only summation order differs;
measured ~5e-6), 1e-4 against a full forward (the eager decode's own tolerance there: chunked vs
whole prefill orders the sums differently too; measured ~1e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang.srt.mem_cache.kimi_k3_cache import KDAState, KimiK3RequestCache, MLALatentCache
from sglang.srt.mem_cache.kimi_k3_slot_pool import KimiK3SlotPool
from sglang.srt.mem_cache.slot_blocks import SlotPoolFullError
from sglang.srt.model_executor.forward_plan import ForwardPlan
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.cpu_model_runner import cpu_model_runner
from sglang.test.kimi_k3_tiny import CONFIG_A, CONFIG_B, CONFIG_C, make_model, tokens
from sglang.test.pooled_decode_checks import check_decode_pooled_refusals, worst_pooled_vs_eager
from sglang.test.release_checkpoint import kimi_k3 as k3_release
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_max_err

register_cpu_ci(est_time=15)

TOL = 2e-5
REF_TOL = 1e-4
BLOCK = 8
CAPACITY = 48


def _pool(model: KimiK3ForCausalLM) -> KimiK3SlotPool:
    assert model.slot_pool is not None
    return model.slot_pool


def _slot_state(pool: KimiK3SlotPool, slots: list[int]) -> list[torch.Tensor]:
    """Every KDA state row of ``slots`` and every latent block they hold, copied."""
    out = [t[slots].clone() for k in pool.kda if k is not None for t in (k.conv, k.recurrent)]
    for s in slots:
        held = pool.blocks.blocks(s).table
        out += [store[held].clone() for store in pool.latents if store is not None]
    return out


@pytest.fixture(scope="module")
def model_a() -> KimiK3ForCausalLM:
    model = make_model(CONFIG_A, seed=41)
    model.enable_slot_pool(max_slots=6, capacity=CAPACITY, block_tokens=BLOCK)
    return model


@pytest.mark.parametrize("which", ["a", "c"])
def test_padded_static_decode_equals_eager(model_a: KimiK3ForCausalLM, which: str) -> None:
    model = model_a
    if which == "c":  # plain residuals, experts on the full hidden
        model = make_model(CONFIG_C, seed=42)
        model.enable_slot_pool(max_slots=6, capacity=CAPACITY, block_tokens=BLOCK)
    pool = _pool(model)
    lengths, steps = (1, 6, 10, 21), 5  # decoding crosses the 8, 16 and 24 block edges
    seqs = [tokens(n + steps + 1, seed=50 + i) for i, n in enumerate(lengths)]
    eager = [model.new_request_cache() for _ in lengths]
    pooled = [model.new_pooled_cache() for _ in lengths]
    idle = model.new_pooled_cache()  # a running request outside this batch
    model.prefill(tokens(11, seed=59), idle)
    for seq, n, e, p in zip(seqs, lengths, eager, pooled):
        model.prefill(seq[:n], e)
        model.prefill(seq[:n], p)
    others = [s for s in range(pool.max_slots) if s not in {p.slot for p in pooled}]
    before = _slot_state(pool, others)
    pad_to = len(lengths) + 2
    worst = worst_pooled_vs_eager(model, seqs, lengths, steps, eager, pooled, pad_to=pad_to)
    print(f"config {which}: static vs eager decode, {steps} steps: rel max err {worst:.2e}")
    assert worst < TOL
    # The idle request and the free slots: not a value changed by the padding rows.
    for snap, now in zip(before, _slot_state(pool, others)):
        assert torch.equal(snap, now)
    # An eager step after static ones continues the same storage (host counts in sync).
    ids = torch.stack([seq[n + steps] for seq, n in zip(seqs, lengths)])
    assert rel_max_err(model.decode(ids, pooled), model.decode(ids, eager)) < TOL
    for e, p in zip(eager, pooled):
        assert len(e) == len(p)
        for le, lp in zip(e.layers, p.layers):
            if isinstance(le, KDAState) and isinstance(lp, KDAState):
                torch.testing.assert_close(lp.conv, le.conv, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(lp.recurrent, le.recurrent, rtol=1e-5, atol=1e-5)
            else:
                assert isinstance(le, MLALatentCache) and isinstance(lp, MLALatentCache)
                assert len(lp) == len(le)
                torch.testing.assert_close(lp.rows.rows(), le.rows.rows(), rtol=1e-5, atol=1e-5)
        model.free_pooled_cache(p)
    model.free_pooled_cache(idle)
    assert pool.num_free == pool.max_slots
    assert pool.block_pool.num_free == pool.block_pool.num_blocks


def _decode_all(
    model: KimiK3ForCausalLM, cache: KimiK3RequestCache, ids: torch.Tensor, prompt: int
) -> torch.Tensor:
    out = [model.prefill(ids[:prompt], cache)]
    out += [model.decode_pooled(ids[t : t + 1], [cache], pad_to=2) for t in range(prompt, len(ids))]
    return torch.cat(out)


def test_reused_slot_sees_none_of_the_former_owner() -> None:
    model = make_model(CONFIG_A, seed=43)
    pool = model.enable_slot_pool(max_slots=1, capacity=CAPACITY, block_tokens=BLOCK)
    first = model.new_pooled_cache()
    with pytest.raises(SlotPoolFullError):
        model.new_pooled_cache()
    _decode_all(model, first, tokens(30, seed=60), 20)  # 4 blocks, states far from zero
    held = sorted(pool.blocks.blocks(0).table)
    model.free_pooled_cache(first)
    assert pool.block_pool.num_free == pool.block_pool.num_blocks
    for prompt in (1, 3):  # a one-token prompt runs the eager decode path on the slot
        reused = model.new_pooled_cache()
        assert reused.slot == 0
        ids = tokens(14, seed=61 + prompt)
        got = _decode_all(model, reused, ids, prompt)
        assert sorted(pool.blocks.blocks(0).table) == held[:2]  # the former owner's blocks
        err = rel_max_err(got, model(ids, torch.arange(ids.shape[0])))
        print(f"reused slot, prompt {prompt}: rel max err vs full forward {err:.2e}")
        assert err < REF_TOL
        model.free_pooled_cache(reused)


def test_static_decode_rejects_unpooled_and_full_caches(model_a: KimiK3ForCausalLM) -> None:
    check_decode_pooled_refusals(model_a, CAPACITY)
    with pytest.raises(ValueError, match="not an allocated slot"):
        _pool(model_a).free(0)


# --- the gate, through the model runner --------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("k3")
    src = make_model(CONFIG_B, seed=44)
    k3_release.write_unquantised(path, CONFIG_B, src)
    return path


def _runner(path: Path, total: int | None) -> tuple[ModelRunner, str]:
    runner, setup = cpu_model_runner(
        str(path), context_length=256, budget=total or 1024, max_running_requests=3,
        max_total_tokens=total,
    )  # fmt: skip
    return runner, setup.cuda_graph


def _plans(vocab: int) -> list[ForwardPlan]:
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab, (n,), generator=g).tolist())

    plans = [ForwardPlan(("a", "b"), (9, 3), ids(12), new_rids=("a", "b"))]
    plans += [ForwardPlan(("a", "b"), (1, 1), ids(2)) for _ in range(3)]
    # mixed: the decode rows static, the chunk eager (mixed_step)
    plans.append(ForwardPlan(("a", "b", "c"), (1, 1, 5), ids(7), new_rids=("c",)))
    plans += [ForwardPlan(("a", "b", "c"), (1, 1, 1), ids(3)) for _ in range(3)]
    # "a" ends; "d" takes its slot (the former owner's states must stay invisible).
    plans.append(ForwardPlan(("d",), (2,), ids(2), new_rids=("d",), free_rids=("a",)))
    plans += [ForwardPlan(("b", "c", "d"), (1, 1, 1), ids(3)) for _ in range(3)]
    plans.append(ForwardPlan(free_rids=("b", "c", "d")))
    return plans


def test_the_runner_decodes_k3_eagerly_when_the_gate_is_off(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Even where the static decode would run without graphs, the gate (on by default) keeps K3
    # eager when it is off.
    monkeypatch.setenv("SGLANG_STATIC_DECODE_WITHOUT_GRAPHS", "1")
    monkeypatch.setenv("SGLANG_K3_STATIC_DECODE", "0")
    eager, line = _runner(checkpoint, 1024)
    assert eager.pooled and eager.static_model is None
    assert line.startswith("off (runs on cpu, not CUDA; SGLANG_K3_STATIC_DECODE is off")
    assert "caches paged in 4 blocks of 256" in line
    monkeypatch.setenv("SGLANG_K3_STATIC_DECODE", "1")
    unbounded, line = _runner(checkpoint, None)  # on CPU the default budget is the worst case
    assert not unbounded.pooled and "set --max-total-tokens to take it" in line
    assert "no GPU memory to measure" in line
    static, line = _runner(checkpoint, 1024)
    assert static.pooled and static.static_model is not None
    assert line.startswith("off (runs on cpu, not CUDA); static decode eager at the graph batch")
    pool = static.model.slot_pool
    assert pool is not None and pool.block_pool.num_blocks == 4
    model = static.model
    assert isinstance(model, KimiK3ForCausalLM)
    static_steps: list[int] = []
    real = model.decode_pooled
    monkeypatch.setattr(
        model, "decode_pooled", lambda *a, **k: static_steps.append(1) or real(*a, **k)
    )
    worst = 0.0
    for plan in _plans(eager.vocab_size):
        want, got = eager.execute(plan), static.execute(plan)
        assert (want is None) == (got is None)
        if want is not None and got is not None:
            worst = max(worst, rel_max_err(got, want))
    print(f"static vs eager runner (K3): rel max err {worst:.2e}")
    # every plan with decode rows went static: 9 decode-only, 1 mixed
    assert worst < TOL and len(static_steps) == 10
    assert pool.num_free == pool.max_slots and not static.caches
    assert pool.block_pool.num_free == pool.block_pool.num_blocks


class _WithoutMemoryModel(KimiK3ForCausalLM):
    memory_model = None  # type: ignore[assignment]  # None: the ability counts as absent


def test_k3_static_decode_needs_no_max_total_tokens_where_its_memory_model_bounds_the_budget(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ServerArgs(model_path=str(checkpoint), device="cpu", random_seed=0).resolved()
    runner = ModelRunner(args, 0, 1)
    model = runner.model
    assert isinstance(model, KimiK3ForCausalLM)
    monkeypatch.setenv("SGLANG_K3_STATIC_DECODE", "0")
    gate = runner._static_decode_reason()
    assert gate is not None and gate.startswith("SGLANG_K3_STATIC_DECODE is off")
    assert "--max-total-tokens" not in gate
    monkeypatch.setenv("SGLANG_K3_STATIC_DECODE", "1")
    cpu = runner._static_decode_reason()
    assert cpu is not None and "--max-total-tokens" in cpu and "no GPU memory to measure" in cpu
    # The scheduler measured the budget on the GPU with K3's memory model (_default_max_total_
    # tokens; test_memory_budget.py): a bound, so the runner preallocates it without the flag.
    runner.device = torch.device("cuda")
    assert runner._static_decode_reason() is None
    setup = runner._init_eager_decode("off (eager)", 256, 1024, 3)  # the gate-off path
    assert runner.pool_model is model and "--max-total-tokens" not in setup.cuda_graph
    assert setup.cuda_graph == "off (eager); caches paged in 4 blocks of 256 tokens, 0.00 GiB"
    # A paged model without a memory model: the default budget is still the worst case.
    monkeypatch.setattr(model, "__class__", _WithoutMemoryModel)
    why = runner._static_decode_reason()
    assert why is not None and "_WithoutMemoryModel has no memory model" in why
    assert "set --max-total-tokens to take it" in why


if __name__ == "__main__":
    run_this_file(__file__)
