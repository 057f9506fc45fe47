"""The scheduling policy without a model: decode rows first, chunked prefill within the step
budget, admission under --max-running-requests and --max-total-tokens (queue, not crash), by
whole cache blocks when the cache is paged, and reservations returned on finish or abort with the
caches freed in the next plan."""

from __future__ import annotations

import pytest

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import SchedulePolicy, Step
from sglang.srt.model_executor.forward_plan import ForwardPlan
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=2)


def _req(rid: str, prompt: int, max_new: int = 4) -> Req:
    return Req(rid, list(range(prompt)), SamplingParams(max_new_tokens=max_new), max_new)


def test_chunked_prefill_then_decode() -> None:
    p = SchedulePolicy(max_running_requests=8, max_total_tokens=1000, chunked_prefill_size=10)
    a = _req("a", 25)
    p.add(a)
    s1 = p.next_step()
    assert s1.plan.new_rids == ("a",) and s1.plan.seq_lens == (10,) and not s1.rows[0].sample
    s2 = p.next_step()
    assert s2.plan.new_rids == () and s2.plan.seq_lens == (10,) and s2.rows[0].prompt_pos == 10
    s3 = p.next_step()
    assert s3.plan.seq_lens == (5,) and s3.rows[0].sample and a.prompt_done
    assert s3.plan.sample_rows == (4,)
    a.output_ids.append(7)
    b = _req("b", 3)
    p.add(b)
    s4 = p.next_step()
    # a decodes (first), b is admitted and prefilled whole in the same step
    assert s4.plan.rids == ("a", "b") and s4.plan.seq_lens == (1, 3)
    assert s4.plan.input_ids[0] == 7 and s4.rows[0].prompt_pos == 25


def test_chunking_off_takes_whole_prompts() -> None:
    p = SchedulePolicy(max_running_requests=8, max_total_tokens=10_000, chunked_prefill_size=-1)
    p.add(_req("a", 3000))
    assert p.next_step().plan.seq_lens == (3000,)


def test_token_budget_queues_then_admits() -> None:
    p = SchedulePolicy(max_running_requests=8, max_total_tokens=100, chunked_prefill_size=1000)
    a, b = _req("a", 50, 10), _req("b", 50, 10)  # 60 tokens each: only one fits
    assert p.can_ever_fit(a) and not p.can_ever_fit(_req("huge", 95, 10))
    p.add(a)
    p.add(b)
    s = p.next_step()
    assert s.plan.new_rids == ("a",) and list(p.waiting) == [b] and p.reserved == 60
    p.release(a)
    assert p.reserved == 0
    s = p.next_step()
    assert s.plan.free_rids == ("a",) and s.plan.new_rids == ("b",)


def test_max_running_requests() -> None:
    p = SchedulePolicy(max_running_requests=2, max_total_tokens=10_000, chunked_prefill_size=1000)
    for i in range(3):
        p.add(_req(f"r{i}", 5))
    assert p.next_step().plan.new_rids == ("r0", "r1") and len(p.waiting) == 1


def test_abort_waiting_and_running() -> None:
    p = SchedulePolicy(max_running_requests=1, max_total_tokens=10_000, chunked_prefill_size=1000)
    p.add(_req("run", 5))
    p.add(_req("wait", 5))
    p.next_step()
    assert p.remove("wait") is not None and not p.waiting
    assert p.remove("run") is not None and not p.running and p.reserved == 0
    assert p.remove("gone") is None
    s = p.next_step()
    assert s.plan.free_rids == ("run",) and not s.plan.has_forward
    assert not p.has_work()


def test_max_new_tokens_zero_is_not_sampled() -> None:
    p = SchedulePolicy(max_running_requests=4, max_total_tokens=100, chunked_prefill_size=100)
    p.add(_req("z", 5, max_new=0))
    s = p.next_step()
    assert not s.rows[0].sample and s.plan.sample_rows == ()


def _step(p: SchedulePolicy) -> Step:
    """The next step, with a token sampled for every row that samples (as the scheduler does)."""
    step = p.next_step()
    for row in step.rows:
        if row.sample:
            row.req.output_ids.append(1)
    return step


def test_admission_by_blocks_runs_more_short_requests_than_whole_context_slots() -> None:
    # 8 blocks of 256 tokens; with 2048-token contexts whole-context slots would run 1 request.
    p = SchedulePolicy(
        max_running_requests=16, max_total_tokens=2048, chunked_prefill_size=4096, block_tokens=256
    )
    short = [_req(f"s{i}", 100, 50) for i in range(8)]  # 150 tokens: 1 block each
    for r in short:
        p.add(r)
    late, long = _req("late", 100, 50), _req("long", 500, 100)  # 3 blocks
    p.add(long)
    p.add(late)
    s = _step(p)
    assert s.plan.new_rids == tuple(r.rid for r in short) and p.reserved == 2048
    # Full: the long request queues (first come first served: "late" waits behind it).
    assert list(p.waiting) == [long, late] and _step(p).plan.new_rids == ()
    p.release(short[0])
    assert _step(p).plan.new_rids == ()  # 1 block free, the head needs 3
    p.release(short[1])
    p.release(short[2])
    s = _step(p)
    assert s.plan.new_rids == ("long",) and s.plan.free_rids == ("s1", "s2")
    assert p.reserved == 2048 and list(p.waiting) == [late]
    for r in short[3:]:
        p.release(r)
    p.release(long)
    assert p.reserved == 0 and _step(p).plan.new_rids == ("late",) and p.reserved == 256
    # A reservation rounds up to whole blocks, so one that exceeds the pool can never fit.
    assert p.can_ever_fit(_req("edge", 2000, 48)) and not p.can_ever_fit(_req("over", 2000, 49))
    with pytest.raises(ValueError, match="block_tokens"):
        SchedulePolicy(
            max_running_requests=1, max_total_tokens=1, chunked_prefill_size=1, block_tokens=0
        )


def _logprob_req(rid: str, prompt: int, start_len: int, max_new: int = 4) -> Req:
    req = _req(rid, prompt, max_new)
    req.return_logprob, req.logprob_start_len = True, start_len
    return req


def test_logit_rows_are_sampled_rows_plus_asked_prompt_rows() -> None:
    """Only the rows whose logits are read come back: the sampled last rows, and the prompt rows
    whose log-probs were asked for (row j predicts token j + 1; from logprob_start_len on)."""
    p = SchedulePolicy(max_running_requests=8, max_total_tokens=1000, chunked_prefill_size=16)
    a = _req("a", 3)  # no log-probs: its last row only
    echo = _logprob_req("echo", 20, 0)  # every prompt row but the last (which is sampled)
    tail = _logprob_req("tail", 6, 4, max_new=0)  # tokens 4..5: rows 3..4; nothing sampled
    for r in (a, echo, tail):
        p.add(r)
    s1 = p.next_step()  # a whole (0..2), echo's first 13 tokens (3..15)
    assert s1.plan.seq_lens == (3, 13) and s1.plan.sample_rows == (2,)
    assert s1.plan.logit_rows == (2, *range(3, 16))
    assert [r.logprob_rows for r in s1.rows] == [range(0), range(3, 16)]
    a.output_ids.append(1)
    s2 = p.next_step()  # a decodes (0), echo's last 7 tokens (1..7), tail whole (8..13)
    assert s2.plan.seq_lens == (1, 7, 6) and s2.plan.sample_rows == (0, 7)
    # echo: rows 1..6 predict its tokens 14..19, row 7 samples; tail: rows 11, 12 (tokens 4, 5)
    assert s2.plan.logit_rows == (0, *range(1, 8), 11, 12)
    assert s2.plan.output_rows == s2.plan.logit_rows and s2.plan.prunes_logits
    assert ForwardPlan(("x",), (2,), (0, 1)).output_rows == (0, 1)  # None: every row


def test_forward_plan_checks_logit_rows() -> None:
    base = {"rids": ("x",), "seq_lens": (3,), "input_ids": (0, 1, 2)}
    with pytest.raises(ValueError, match="in \\[0, 3\\)"):
        ForwardPlan(**base, logit_rows=(3,))
    with pytest.raises(ValueError, match="ascending"):
        ForwardPlan(**base, logit_rows=(1, 1))
    with pytest.raises(ValueError, match="not in logit_rows"):
        ForwardPlan(**base, sample_rows=(2,), logit_rows=(1,))
    with pytest.raises(ValueError, match="sub-plans only"):
        ForwardPlan(dp_plans=(ForwardPlan(**base),), logit_rows=())


if __name__ == "__main__":
    run_this_file(__file__)
