"""``--max-logit-rows-per-step`` in the scheduling policy, without a model: no step (and no DP
group's sub-plan) computes more logit rows than the cap, with long echo prompts beside many
decoders; an echo chunk is shortened to the rows left and continues next step; every request still
gets every prompt log-prob row it asked for exactly once and every sample, as without the cap; a
cap below --max-running-requests is refused."""

from __future__ import annotations

import random

import pytest

from sglang.srt.managers.dp_schedule_policy import DpSchedulePolicy
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import SchedulePolicy, Step
from sglang.srt.model_executor.forward_plan import ForwardPlan
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=2)


def _req(rid: str, prompt: int, max_new: int, logprob_start: int | None = None) -> Req:
    req = Req(rid, list(range(prompt)), SamplingParams(max_new_tokens=max_new), max_new)
    if logprob_start is not None:
        req.return_logprob, req.logprob_start_len = True, logprob_start
    return req


def _workload(seed: int) -> list[Req]:
    """Long echo prompts (from 0, from a start, prompt-only) among many short decoders."""
    rng = random.Random(seed)
    reqs = [
        _req("echo", 300, 3, 0),
        _req("echo-tail", 200, 2, 120),
        _req("prompt-only", 150, 0, 10),
    ]
    for i in range(20):
        reqs.append(_req(f"d{i}", rng.randint(1, 40), rng.randint(1, 12)))
    rng.shuffle(reqs)
    return reqs


def _drive(
    policy: SchedulePolicy | DpSchedulePolicy, reqs: list[Req]
) -> tuple[dict[str, list[int]], list[Step]]:
    """Run the policy to the end, sampling token 0 for every sampled row. Returns, per request,
    the prompt positions whose log-probs it got (row j of a chunk from ``p`` predicts p + j + 1),
    its samples, and the steps; every plan's logit rows are checked against the cap."""
    for r in reqs:
        policy.add(r)
    got: dict[str, list[int]] = {r.rid: [] for r in reqs}
    steps: list[Step] = []
    while policy.has_work():
        step = policy.next_step()
        assert len(steps) < 5000, "the policy stopped making progress"
        steps.append(step)
        for row in step.rows:
            got[row.req.rid] += [row.prompt_pos + i - row.start + 1 for i in row.logprob_rows]
            if row.sample:
                row.req.output_ids.append(0)
        for row in step.rows:
            req = row.req
            done = req.prompt_done and len(req.output_ids) >= req.max_new_tokens
            if done and req in policy.running:
                policy.release(req)
    assert all(r.prompt_done and len(r.output_ids) == r.max_new_tokens for r in reqs)
    return got, steps


def _plans(step: Step) -> list[ForwardPlan]:
    return list(step.plan.dp_plans) or [step.plan]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cap", [8, 13])
def test_steps_never_exceed_the_cap_and_every_row_still_comes(seed: int, cap: int) -> None:
    budget = {"max_running_requests": 8, "max_total_tokens": 4000, "chunked_prefill_size": 64}
    free, free_steps = _drive(SchedulePolicy(**budget), _workload(seed))
    capped, capped_steps = _drive(SchedulePolicy(**budget, max_logit_rows=cap), _workload(seed))
    assert max(len(s.plan.logit_rows or ()) for s in free_steps) > cap  # the cap has work to do
    assert all(len(s.plan.logit_rows or ()) <= cap for s in capped_steps)
    assert len(capped_steps) > len(free_steps)
    want = {
        "echo": list(range(1, 300)),  # every prompt token but the first
        "echo-tail": list(range(120, 200)),
        "prompt-only": list(range(10, 150)),
    }
    for rid, positions in capped.items():
        assert positions == free[rid] == want.get(rid, []), rid


def test_echo_chunk_is_shortened_to_the_rows_left() -> None:
    """Cap 4 with 3 decoders: the echo from 0 gets one row (one token a step); an echo from
    logprob_start_len 10 prefills its first 9 tokens free (no rows) plus one more."""
    p = SchedulePolicy(
        max_running_requests=4, max_total_tokens=1000, chunked_prefill_size=64, max_logit_rows=4
    )
    decoders = [_req(f"d{i}", 2, 50) for i in range(3)]
    for d in decoders:
        p.add(d)
    p.next_step()
    for d in decoders:
        d.output_ids.append(0)
    echo = _req("echo", 30, 2, 0)
    p.add(echo)
    s = p.next_step()
    assert s.plan.seq_lens == (1, 1, 1, 1) and len(s.plan.logit_rows) == 4 and echo.prefilled == 1
    p.release(echo)
    tail = _req("tail", 30, 2, 10)
    p.add(tail)
    for d in decoders:
        d.output_ids.append(0)
    s = p.next_step()
    assert s.plan.seq_lens == (1, 1, 1, 10) and tail.prefilled == 10
    assert s.plan.logit_rows == (0, 1, 2, 12)  # its row 9 predicts token 10


def test_completing_chunk_waits_for_its_sample_row() -> None:
    """Rows run out: a plain prompt stops one token short of completing (its sample row); next
    step the echo before it leaves it that row; a waiting request that needs a row waits."""
    p = SchedulePolicy(
        max_running_requests=4, max_total_tokens=1000, chunked_prefill_size=64, max_logit_rows=4
    )
    d = _req("d", 1, 50)
    p.add(d)
    p.next_step()
    d.output_ids.append(0)
    echo, plain, late = _req("echo", 30, 2, 0), _req("plain", 5, 2), _req("late", 1, 2)
    for r in (echo, plain):
        p.add(r)
    s = p.next_step()  # d decodes (1 row), echo takes the 3 rows left, plain gets 4 of 5 tokens
    assert s.plan.seq_lens == (1, 3, 4) and not s.rows[2].sample and len(s.plan.logit_rows) == 4
    p.add(late)
    d.output_ids.append(0)
    s = p.next_step()  # d 1 row, echo 2 (one kept for plain), plain completes; late waits
    assert s.plan.seq_lens == (1, 2, 1) and s.rows[2].sample and plain.prompt_done
    assert len(s.plan.logit_rows) == 4 and list(p.waiting) == [late]


def test_dp_groups_each_respect_the_cap() -> None:
    budget = {"max_running_requests": 8, "max_total_tokens": 4000, "chunked_prefill_size": 64}
    got, steps = _drive(DpSchedulePolicy(2, **budget, max_logit_rows=9), _workload(5))
    subs = [sub.logit_rows for s in steps for sub in _plans(s)]
    assert all(rows is not None and len(rows) <= 9 for rows in subs)
    assert max(len(rows or ()) for rows in subs) == 9
    assert got["echo"] == list(range(1, 300)) and got["echo-tail"] == list(range(120, 200))


def test_cap_below_max_running_is_refused() -> None:
    with pytest.raises(ValueError, match="max_logit_rows 3 is below max_running_requests 4"):
        SchedulePolicy(
            max_running_requests=4, max_total_tokens=10, chunked_prefill_size=8, max_logit_rows=3
        )


if __name__ == "__main__":
    run_this_file(__file__)
