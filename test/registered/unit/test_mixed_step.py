"""``split_mixed_step``: which rows of a plan go to the static decode (one token of a request
whose cache holds tokens) and which run eagerly, the eager sub-batch's ids, lengths and logit
rows, and the order that puts cat([decode logits, eager logits]) back into the plan's output
order; plans with nothing to split are left alone."""

from __future__ import annotations

from sglang.srt.model_executor.forward_plan import ForwardPlan
from sglang.srt.model_executor.mixed_step import split_mixed_step
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=1)


def test_a_chunk_between_decode_rows_with_pruned_logits() -> None:
    # rows: a (decode) 0 | e (chunk of 3, not sampling) 1-3 | c (decode) 4 | f (first token) 5
    plan = ForwardPlan(
        ("a", "e", "c", "f"),
        (1, 3, 1, 1),
        (10, 20, 21, 22, 30, 40),
        logit_rows=(0, 4, 5),
        sample_rows=(0, 4, 5),
    )
    split = split_mixed_step(plan, [7, 5, 9, 0])  # f's cache is empty: its token is a prefill
    assert split is not None
    assert split.decode == (0, 2) and split.eager == (1, 3)
    assert split.decode_ids == (10, 30)
    assert split.eager_ids == (20, 21, 22, 40) and split.eager_lens == (3, 1)
    assert split.eager_logit_rows == (3,)  # only f's row of the eager sub-batch
    # output rows 0, 4, 5 -> decode logits 0 and 1, then the eager logits' row 0 (after the 2)
    assert split.order == (0, 1, 2)


def test_every_row_returned() -> None:
    plan = ForwardPlan(("p", "d"), (2, 1), (1, 2, 3))
    split = split_mixed_step(plan, [0, 4])
    assert split is not None
    assert split.eager_logit_rows is None  # the eager forward returns all its rows
    # output rows 0, 1 (p's chunk), 2 (d) -> eager 0, eager 1, decode 0
    assert split.order == (1, 2, 0)


def test_nothing_to_split() -> None:
    assert split_mixed_step(ForwardPlan(("a", "b"), (1, 1), (1, 2)), [3, 3]) is None  # decode
    assert split_mixed_step(ForwardPlan(("a",), (4,), (1, 2, 3, 4)), [0]) is None  # prefill
    assert split_mixed_step(ForwardPlan(("a", "b"), (1, 2), (1, 2, 3)), [0, 0]) is None


if __name__ == "__main__":
    run_this_file(__file__)
