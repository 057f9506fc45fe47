"""Scheduling under DP attention without a model: requests balanced over the DP groups, one
ForwardPlan with a sub-plan per group (an idle group's empty, still a step), rows and sampled
rows indexing the groups' logits in group order, the padding mode from the token counts; and a
model that cannot serve DP attention refused at startup with its reason."""

from __future__ import annotations

import pytest
from sglang.srt.layers.dp_attention import DpPaddingMode, choose_dp_padding
from sglang.srt.managers.dp_schedule_policy import DpSchedulePolicy
from sglang.srt.managers.launcher import resolve_model_path
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_process import check_dp_attention
from sglang.srt.model_executor.forward_plan import ForwardPlan
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)


def _req(rid: str, prompt: int, max_new: int = 4) -> Req:
    return Req(rid, list(range(prompt)), SamplingParams(max_new_tokens=max_new), max_new)


def _policy() -> DpSchedulePolicy:
    return DpSchedulePolicy(
        2, max_running_requests=4, max_total_tokens=100, chunked_prefill_size=64
    )


def test_requests_balanced_and_one_plan_per_group() -> None:
    p = _policy()
    a, b, c = _req("a", 5), _req("b", 6), _req("c", 2)
    for r in (a, b, c):
        p.add(r)
    assert p.group_of == {"a": 0, "b": 1, "c": 0}  # fewest requests, then fewest reserved tokens
    step = p.next_step()
    plan = step.plan
    assert plan.has_forward and plan.rids == () and plan.dp_num_tokens == (7, 6)
    assert [s.rids for s in plan.dp_plans] == [("a", "c"), ("b",)]
    assert plan.for_dp_rank(1).new_rids == ("b",)
    # Rows index the groups' logits concatenated: group 1 starts after group 0's 7 tokens.
    assert [(r.req.rid, r.start, r.length) for r in step.rows] == [
        ("a", 0, 5),
        ("c", 5, 2),
        ("b", 7, 6),
    ]
    assert plan.sample_rows == (4, 6, 12)
    assert plan.dp_padding == "max_len"  # 7 * 2 <= 2 * 13
    assert p.reserved == 9 + 10 + 6 and len(p.running) == 3


def test_idle_group_still_steps_and_frees_reach_their_group() -> None:
    p = _policy()
    a = _req("a", 40)
    p.add(a)
    first = p.next_step().plan
    assert first.dp_num_tokens == (40, 0) and first.dp_padding == "max_len"
    assert not first.dp_plans[1].has_forward and first.has_forward
    assert first.for_dp_rank(1).is_noop
    a.output_ids.append(1)
    a.finish = None
    p.release(a)
    nxt = p.next_step().plan
    assert nxt.dp_plans[0].free_rids == ("a",) and not nxt.has_forward and not nxt.is_noop
    assert p.next_step().plan.is_noop and not p.has_work()
    assert p.remove("a") is None  # gone from every group


def test_abort_removes_from_its_group() -> None:
    p = _policy()
    for rid in ("a", "b"):
        p.add(_req(rid, 4))
    assert p.remove("b") is not None and p.group_of == {"a": 0}
    assert [r.rid for r in p.waiting] == ["a"]


def test_padding_choice() -> None:
    assert choose_dp_padding([3, 3]) is DpPaddingMode.MAX_LEN
    assert choose_dp_padding([0, 0]) is DpPaddingMode.MAX_LEN
    assert choose_dp_padding([100, 1, 1, 1]) is DpPaddingMode.SUM_LEN


def test_dp_plan_checks() -> None:
    with pytest.raises(ValueError, match="sub-plans only"):
        ForwardPlan(rids=("a",), seq_lens=(1,), input_ids=(0,), dp_plans=(ForwardPlan(),))
    with pytest.raises(ValueError, match="dp_padding"):
        ForwardPlan(dp_padding="mean")


def test_model_without_dp_support_is_refused_at_startup() -> None:
    # What every rank checks before it loads the model (in-process: a spawned pair costs 16 s).
    args = ServerArgs(device="cpu", tp_size=2, dp_size=2, enable_dp_attention=True).resolved()
    args.validate()
    with pytest.raises(RuntimeError, match="--enable-dp-attention --dp-size 2: DeepseekV4"):
        check_dp_attention(resolve_model_path(args))


if __name__ == "__main__":
    run_this_file(__file__)
