"""Scheduling under DP attention without a model: requests balanced over the DP groups, one
ForwardPlan with a sub-plan per group (an idle group's empty, still a step), rows and sampled
rows indexing the groups' logits in group order, the padding mode from the token counts; and
which models can serve DP attention (checked before the load)."""

from __future__ import annotations

import dataclasses

import pytest

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.dp_attention import (
    DpPaddingMode,
    attention_spec,
    attention_tp,
    choose_dp_padding,
    set_dp_attention_config,
)
from sglang.srt.managers.dp_schedule_policy import DpSchedulePolicy
from sglang.srt.managers.launcher import resolve_model_path
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_process import check_dp_attention
from sglang.srt.model_executor.forward_plan import ForwardPlan
from sglang.srt.models.registry import dp_attention_unsupported_reason, model_entries
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
    # Each group returns only its sampled rows; rank 0 gets them in group order.
    assert [s.logit_rows for s in plan.dp_plans] == [(4, 6), (5,)]
    assert plan.logit_rows is None and plan.output_rows == (4, 6, 12)
    assert plan.dp_padding == "max_len"  # 2 groups x 7 padded rows <= 1.5 x 13
    assert p.reserved == 9 + 10 + 6 and len(p.running) == 3


def test_idle_group_still_steps_and_frees_reach_their_group() -> None:
    p = _policy()
    a = _req("a", 40)
    p.add(a)
    first = p.next_step().plan
    assert first.dp_num_tokens == (40, 0) and first.dp_padding == "sum_len"
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
    assert choose_dp_padding([3, 2]) is DpPaddingMode.MAX_LEN  # 6 rows for 5
    assert choose_dp_padding([4, 1]) is DpPaddingMode.SUM_LEN  # 8 rows for 5
    assert choose_dp_padding([5, 0]) is DpPaddingMode.SUM_LEN  # an idle group
    assert choose_dp_padding([0, 0]) is DpPaddingMode.MAX_LEN
    assert choose_dp_padding([100, 1, 1, 1]) is DpPaddingMode.SUM_LEN


def test_dp_plan_checks() -> None:
    with pytest.raises(ValueError, match="sub-plans only"):
        ForwardPlan(rids=("a",), seq_lens=(1,), input_ids=(0,), dp_plans=(ForwardPlan(),))
    with pytest.raises(ValueError, match="dp_padding"):
        ForwardPlan(dp_padding="mean")


def test_dp_attention_support_checked_before_load() -> None:
    # What every rank checks before it loads the model (in-process: a spawned pair costs 16 s).
    args = ServerArgs(device="cpu", tp_size=2, dp_size=2, enable_dp_attention=True).resolved()
    args.validate()
    check_dp_attention(resolve_model_path(args))  # DeepSeek V4 gathers around its MoE
    models = model_entries()
    assert len(models) == 2  # DSv4 and Kimi K3
    assert all(dp_attention_unsupported_reason(m) is None for m in models)
    other = dataclasses.replace(models[0], supports_dp_attention=False)
    why = dp_attention_unsupported_reason(other)
    assert why is not None and "does not gather its tokens around the MoE" in why


def test_attention_place_within_its_dp_group() -> None:
    """TP=4, DP=2: attention TP=2, ranks (0, 1) and (2, 3) each one group; the attention spec
    names the attention-TP group its row-parallel layers reduce over."""
    spec = LayerBuildSpec(tp_rank=3, tp_size=4)
    assert attention_spec(spec) is spec  # DP attention off: the TP place itself
    set_dp_attention_config(True, dp_size=2, attn_tp_size=2)
    try:
        assert [attention_tp(r, 4) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
        attn = attention_spec(spec)
        assert (attn.tp_rank, attn.tp_size, attn.tp_group) == (1, 2, "attn_tp")
        assert attn.replicated().tp_size == 1
        with pytest.raises(ValueError, match="built for TP size 8"):
            attention_tp(0, 8)
    finally:
        set_dp_attention_config(False)


if __name__ == "__main__":
    run_this_file(__file__)
