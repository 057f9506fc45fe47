"""The benchmark's workloads (``sglang.bench_workloads``): a generated shared prefix group's
prompts share its system prompt (reusable from the group's second prompt on), groups are shuffled
together, and a multi-turn chat's turn resends the system prompt, every earlier message and the
server's answers (ids and chat messages alike), its reusable tokens being the previous turn's
whole sequence."""

from __future__ import annotations

import random

from sglang.bench_workloads import conversation_turn, conversations, shared_prefix_requests
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=1)


def test_generated_shared_prefix_groups() -> None:
    reqs = shared_prefix_requests(
        random.Random(0),
        num_groups=3,
        prompts_per_group=4,
        system_len=20,
        question_len=5,
        output_len=7,
        vocab_size=1000,
    )
    assert len(reqs) == 12 and all(len(r.input_ids) == 25 and r.output_len == 7 for r in reqs)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(reqs):
        groups.setdefault(tuple(r.input_ids[:20]), []).append(i)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    assert [i for g in groups.values() for i in g] != list(range(12))  # interleaved
    for members in groups.values():
        assert [reqs[i].reusable for i in members] == [0, 20, 20, 20]
        assert len({tuple(reqs[i].input_ids[20:]) for i in members}) == 4


def test_multi_turn_resends_the_whole_chat() -> None:
    (chat,) = conversations(
        random.Random(1),
        num_conversations=1,
        turns=3,
        system_len=8,
        message_len=4,
        output_len=6,
        vocab_size=500,
    )
    first = conversation_turn(chat, 0, [])
    assert first.input_ids == chat.system.ids + chat.messages[0].ids and first.reusable == 0
    answers = [([1, 2, 3], "x y z")]
    second = conversation_turn(chat, 1, answers)
    assert second.input_ids == first.input_ids + [1, 2, 3] + chat.messages[1].ids
    assert second.reusable == len(first.input_ids) + 3
    roles = [m["role"] for m in second.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert second.messages[2]["content"] == "x y z" and second.output_len == 6


if __name__ == "__main__":
    run_this_file(__file__)
