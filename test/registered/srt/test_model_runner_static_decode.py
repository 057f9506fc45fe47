"""The model runner with the static decode (slot pool), run eagerly on CPU, against the default
per-request path: the same plans (chunked prefill, mixed prefill + decode steps, decode-only
steps, frees and new requests reusing freed slots and blocks) give the same logits in fp32
(tolerance 1e-4 of the largest |logit|; only summation order differs), with mixed steps split
into the static decode of their decode rows and an eager forward of their chunks (the default)
or run as one eager forward (``SGLANG_MIXED_STEP_GRAPHS=0``). Also: the startup
decision's wording, the slot plan, and the captured batch sizes. The graph replay itself is
tested on the GPU (test/registered/models/test_deepseek_v4_cuda_graph_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.block_admission import slot_concurrency
from sglang.srt.model_executor.cuda_graph_runner import capture_batch_sizes
from sglang.srt.model_executor.forward_plan import ForwardPlan
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.slot_plan import plan_slot_pool
from sglang.test.ci_register import register_cpu_ci
from sglang.test.cpu_model_runner import default_model_runner
from sglang.test.run import run_this_file

register_cpu_ci(est_time=30)

TOL = 1e-4


def _runner(static: bool) -> ModelRunner:
    runner, setup = default_model_runner(static)
    if static:
        # Paged: every running request gets a slot (whole contexts would fit 1200 // 400 = 3),
        # and admission is by the pool's whole blocks.
        assert runner.pooled and setup.max_running_requests == 4
        pool = runner.model.slot_pool
        assert pool is not None and setup.block_tokens == pool.block_pool.block_tokens > 1
        assert setup.max_total_tokens == pool.block_pool.num_blocks * setup.block_tokens <= 1200
        assert setup.cuda_graph.startswith(
            "off (runs on cpu, not CUDA); static decode eager at the graph batch sizes"
        )
    else:
        assert not runner.pooled and setup.cuda_graph == (
            "off (runs on cpu, not CUDA; the static decode of DeepseekV4ForCausalLM preallocates "
            "its paged caches and the default budget is the worst case (on cpu there is no GPU "
            "memory to measure): set --max-total-tokens to take it); caches per request"
        )
    return runner


def _plans(vocab: int) -> list[ForwardPlan]:
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab, (n,), generator=g).tolist())

    plans = [
        ForwardPlan(("a", "b"), (40, 7), ids(47), new_rids=("a", "b")),
        ForwardPlan(("a", "b"), (1, 1), ids(2)),
        ForwardPlan(("a", "b", "c"), (1, 1, 130), ids(132), new_rids=("c",)),  # mixed: eager
    ]
    plans += [ForwardPlan(("a", "b", "c"), (1, 1, 1), ids(3)) for _ in range(36)]
    # "a" ends; "d" takes its slot (the former owner's rows must stay invisible).
    plans.append(ForwardPlan(("d",), (3,), ids(3), new_rids=("d",), free_rids=("a",)))
    plans += [ForwardPlan(("b", "c", "d"), (1, 1, 1), ids(3)) for _ in range(6)]
    # "e" arrives in two chunks between decode rows, only the sampled rows' logits returned: the
    # mixed steps split into the static decode and an eager forward (mixed_step).
    chunk = {"logit_rows": (0, 61, 62), "sample_rows": (0, 61, 62)}
    plans.append(ForwardPlan(("b", "e", "c", "d"), (1, 60, 1, 1), ids(63), ("e",), **chunk))
    last = {"logit_rows": (0, 1, 2, 22), "sample_rows": (0, 1, 2, 22)}
    plans.append(ForwardPlan(("b", "c", "d", "e"), (1, 1, 1, 20), ids(23), **last))
    plans += [ForwardPlan(("b", "c", "d", "e"), (1, 1, 1, 1), ids(4)) for _ in range(3)]
    plans.append(ForwardPlan(free_rids=("b", "c", "d", "e")))
    return plans


@pytest.mark.parametrize("split_mixed", [True, False])
def test_static_runner_matches_eager_runner(
    split_mixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_MIXED_STEP_GRAPHS", "1" if split_mixed else "0")
    eager, static = _runner(False), _runner(True)
    pool = static.model.slot_pool
    # Which rows each of the static runner's forwards ran: (static decode rows, eager rows).
    ran: list[tuple[int, int]] = []
    real_decode, real_eager = static._decode_static, static._forward_eager
    monkeypatch.setattr(
        static,
        "_decode_static",
        lambda m, ids, c: ran.append((len(ids), 0)) or real_decode(m, ids, c),
    )
    monkeypatch.setattr(
        static,
        "_forward_eager",
        lambda ids, lens, c, r: ran.append((0, len(ids))) or real_eager(ids, lens, c, r),
    )
    worst = 0.0
    mixed: list[list[tuple[int, int]]] = []
    for plan in _plans(eager.vocab_size):
        ran.clear()
        want, got = eager.execute(plan), static.execute(plan)
        assert (want is None) == (got is None)
        if want is not None and got is not None:
            assert got.shape == want.shape
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        if 1 in plan.seq_lens and max(plan.seq_lens, default=1) > 1 and len(plan.rids) > 2:
            mixed.append(list(ran))
    print(f"static vs eager runner: rel max err {worst:.2e}")
    assert worst < TOL
    # The three mixed steps (2, 2 and 3 decode rows beside a chunk of 130, 60 and 20 tokens).
    if split_mixed:
        assert mixed == [[(2, 0), (0, 130)], [(3, 0), (0, 60)], [(3, 0), (0, 20)]]
    else:
        assert mixed == [[(0, 132)], [(0, 63)], [(0, 23)]]
    assert pool is not None and pool.num_free == pool.max_slots and not static.caches
    blocks = pool.block_pool
    assert blocks.num_free == blocks.num_blocks  # every block back after the requests finished


def test_slot_plan_and_batch_sizes() -> None:
    assert (
        plan_slot_pool(context_length=4096, max_total_tokens=10**6, max_running_requests=32).slots
        == 32
    )
    # Paged: slots no longer cost a whole context each; the token budget is shared by blocks.
    small = plan_slot_pool(context_length=4096, max_total_tokens=9000, max_running_requests=32)
    assert (small.slots, small.capacity, small.total_tokens) == (32, 4096, 9000)
    assert slot_concurrency(9000, 4096, 32) == 2
    tiny = plan_slot_pool(context_length=4096, max_total_tokens=300, max_running_requests=8)
    assert (tiny.slots, tiny.capacity) == (8, 300)
    assert slot_concurrency(300, 4096, 8) == 1
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


if __name__ == "__main__":
    run_this_file(__file__)
