"""Serving with the paged slot pool on CPU (the static decode run eagerly): the scheduler's policy
admits by free blocks and the model runner allocates them as requests grow and returns them as
they finish.

The default model (ratios 0/4/128/4: blocks of 256 tokens), 1024-token contexts and a 1024-token
budget: whole-context slots would run one request at a time, the 4 blocks run four 70-token
requests at once. Seven requests go through the same plans on the paged runner and on the default
per-request runner: the logits agree (1e-4 of the largest |logit|), the pool never runs out (no
request fails), the queue drains, and every block and slot is back at the end.
"""

from __future__ import annotations

import torch

from sglang.srt.default_model.generate import ensure_default_model
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.mem_cache.block_admission import slot_concurrency
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.cpu_model_runner import cpu_model_runner, serve_on_both
from sglang.test.run import run_this_file

register_cpu_ci(est_time=20)

CONTEXT, BUDGET, RUNNING = 1024, 1024, 8


def _runner(static: bool) -> tuple[ModelRunner, int, int]:
    # The static decode preallocates the budget: only where it is a bound (the flag on CPU).
    runner, setup = cpu_model_runner(
        ensure_default_model(),
        context_length=CONTEXT,
        budget=BUDGET,
        max_running_requests=RUNNING,
        max_total_tokens=BUDGET if static else None,
        static_without_graphs=static,
    )
    return runner, setup.block_tokens, setup.max_total_tokens or BUDGET


def test_admission_by_blocks_through_the_runner() -> None:
    paged, block_tokens, total = _runner(True)
    eager, _, _ = _runner(False)
    assert block_tokens == 256 and total == 1024 and paged.pooled
    policy = SchedulePolicy(
        max_running_requests=RUNNING,
        max_total_tokens=total,
        chunked_prefill_size=512,
        block_tokens=block_tokens,
    )
    g = torch.Generator().manual_seed(1)
    vocab = paged.vocab_size
    for i in range(7):
        prompt = torch.randint(0, vocab, (40 + i,), generator=g).tolist()
        policy.add(Req(f"r{i}", prompt, SamplingParams(max_new_tokens=30), 30))
    run = serve_on_both(policy, paged, eager)
    print(
        f"{run.steps} steps, at most {run.most_running} running, "
        f"paged vs eager rel max err {run.worst_rel_err:.2e}"
    )
    assert slot_concurrency(BUDGET, CONTEXT, 8) == 1
    assert run.most_running == 4  # one block each: the pool's 4 blocks, not 1 whole-context slot
    assert run.worst_rel_err < 1e-4
    pool = paged.model.slot_pool
    assert pool is not None and not paged.caches and pool.num_free == pool.max_slots
    assert pool.block_pool.num_free == pool.block_pool.num_blocks  # no block leaked


if __name__ == "__main__":
    run_this_file(__file__)
