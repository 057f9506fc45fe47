"""The scheduling policy with the prefix cache, without a model (the steps are taken as run):

- a request whose prompt extends a cached prefix starts its prefill there (the cached tokens are
  neither computed nor reserved: the tree holds their blocks), and says so (``cached_tokens``);
- prefill chunks end at the prompt's last block edge and at a branch point, where the step's
  blocks and a snapshot go to the tree (``cache_step``), and decoding hands over one snapshot a
  block edge, keeping only the latest;
- admission evicts unlocked cached blocks when the pool is short, before a request waits; a
  running request's prefix is never evicted, and the budget (running + cached) always holds;
- ``lpm`` offers admission by the longest cached prefix, but a request that waited past the age
  bound goes first (an injected clock);
- under DP attention every group has its own tree and a request goes to the group that caches
  its prefix, unless that group is far busier;
- at the scale of ``bench_serving``'s multi-turn workload (16 chats of 6 turns at once, 256-token
  blocks), the default snapshot budget (two a running request) serves over 90% of the reusable
  tokens (the rest is block rounding); one a running request would lose the chats' latest
  snapshots to each other's.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from sglang.bench_workloads import conversation_turn, conversations
from sglang.srt.managers.dp_schedule_policy import DpSchedulePolicy
from sglang.srt.managers.io_struct import FinishReason
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import SchedulePolicy, Step
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.radix_ops import InsertNode, PrefixHit, SaveSnapshot
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=2)

B = 8


def _req(rid: str, prompt: Sequence[int], max_new: int = 3) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_new_tokens=max_new), max_new)


def _policy(total: int = 40 * B, chunk: int = 64, **kw: object) -> SchedulePolicy:
    return SchedulePolicy(
        max_running_requests=4,
        max_total_tokens=total,
        chunked_prefill_size=chunk,
        block_tokens=B,
        prefix_cache=RadixCache(B, snapshot_rows=4),
        **kw,  # type: ignore[arg-type]
    )


def _run(p: SchedulePolicy, step: Step) -> None:
    """Take the step as run: cache what it left, sample token 7, finish at max_new_tokens."""
    p.cache_step(step.rows)
    for row in step.rows:
        if row.sample:
            row.req.output_ids.append(7)
            if len(row.req.output_ids) == row.req.max_new_tokens:
                p.release(row.req)


def _drain(p: SchedulePolicy) -> list[Step]:
    steps = []
    while p.has_work():
        steps.append(p.next_step())
        _run(p, steps[-1])
    return steps


def _budget_holds(p: SchedulePolicy) -> None:
    assert p.reserved >= 0 and p.reserved + p.cached_cache_tokens <= p.max_total_tokens


def test_a_cached_prefix_is_skipped_and_not_reserved() -> None:
    p = _policy()
    prompt = list(range(100, 130))  # 30 tokens: last block edge 24
    a = _req("a", prompt)
    p.add(a)
    first = p.next_step()
    assert first.plan.seq_lens == (24,) and not first.plan.prefix_hits  # cut at the edge
    assert p.reserved == 5 * B  # ceil(33 / 8) blocks
    _run(p, first)
    assert a.inserted_tokens == 24 and p.reserved == 2 * B and p.cached_cache_tokens == 3 * B
    steps = _drain(p)
    assert steps[0].plan.seq_lens == (6,)
    ops = steps[0].plan.cache_ops
    assert ops and isinstance(ops[0], InsertNode) and isinstance(ops[1], SaveSnapshot)
    assert p.reserved == 0 and not p.running
    b = _req("b", prompt + [5, 6, 7, 8])
    p.add(b)
    step = p.next_step()
    assert step.plan.prefix_hits == (PrefixHit("b", step.plan.prefix_hits[0].nodes, 24),)
    assert step.rows[0].prompt_pos == 24 and step.plan.seq_lens == (8,)  # up to the edge at 32
    assert b.cached_tokens == 24 and p.reserved == 5 * B - 24  # ceil(37 / 8) blocks less 3
    assert (p.prompt_tokens, p.cached_tokens) == (64, 24)
    _run(p, step)
    _drain(p)
    _budget_holds(p)


def test_branch_point_gets_a_snapshot_and_decode_keeps_its_latest() -> None:
    p = _policy()
    base = list(range(200, 216))  # two blocks
    p.add(_req("a", base + list(range(50, 70)), max_new=2))  # 36 tokens
    _drain(p)
    c = _req("c", base + list(range(300, 320)), max_new=2)  # shares two blocks, no snapshot there
    p.add(c)
    step = p.next_step()
    assert c.cached_tokens == 0 and step.plan.seq_lens == (16,)  # ends at the branch point
    _run(p, step)
    _drain(p)
    d = _req("d", base + [1] * 9)
    p.add(d)
    p.next_step()
    assert d.cached_tokens == 16  # resumes at the branch point "c" saved
    p2 = _policy()
    long = _req("l", list(range(12)), max_new=30)  # decodes across the 16, 24, 32, 40 edges
    p2.add(long)
    seen: list[int] = []
    tree = p2.prefix_cache
    assert tree is not None
    while p2.has_work():
        s = p2.next_step()
        _run(p2, s)
        seen.append(tree.num_snapshots)
    # The prompt's edge (8) keeps its snapshot; each decode edge's replaced the one before.
    assert max(seen) == seen[-1] == 2
    assert long.inserted_tokens == 40 and tree.num_blocks == 5
    # A superseded snapshot another request resumed from stays.
    p3 = _policy()
    p3.add(_req("m", list(range(20)), max_new=30))  # prompt edge 16, decode edges 24 .. 48
    while p3.running or p3.waiting:
        step = p3.next_step()
        _run(p3, step)
        if p3.running and p3.running[0].inserted_tokens == 24:
            p3.add(_req("fork", list(range(20)) + [7] * 5 + [1]))  # resumes at 24
    tree3 = p3.prefix_cache
    assert tree3 is not None
    _drain(p3)
    seq = list(range(20)) + [7] * 30  # "m"'s cache: its prompt, then its outputs (all 7)
    kept = [e for e in (16, 24, 32, 40, 48) if tree3.match(seq, limit=e).cached_tokens == e]
    assert kept == [16, 24, 48]  # its prompt's edge, the one "fork" resumed from, its latest


def test_eviction_makes_room_before_a_request_waits() -> None:
    p = _policy(total=8 * B, chunk=64)
    for i in range(3):
        p.add(_req(f"r{i}", [1000 * i + t for t in range(3 * B + 1)], max_new=2))
        _drain(p)
        _budget_holds(p)
    tree = p.prefix_cache
    assert tree is not None
    evicted = tree.evicted_blocks
    assert evicted > 0 and p.cached_cache_tokens <= 8 * B  # older prefixes made way
    # A running request's prefix is never evicted: "x" holds r2's prefix while "y" needs room.
    x = _req("x", [2000 + t for t in range(3 * B)] + [9] * 3, max_new=20)
    p.add(x)
    _run(p, p.next_step())
    assert x.cached_tokens == 3 * B
    y = _req("y", list(range(5000, 5000 + 4 * B)), max_new=4)
    p.add(y)
    while x.finish is None:  # "y" waits for "x"'s blocks, whose prefix stays cached
        assert y.prefilled == 0 and x.prefix_node is not None and x.prefix_node.parent is not None
        _run(p, p.next_step())
        _budget_holds(p)
        if len(x.output_ids) == x.max_new_tokens:
            x.finish = FinishReason("length")
    _run(p, p.next_step())
    assert y.prefilled > 0  # admitted once "x" let go, evicting cached blocks for its own
    _drain(p)
    assert p.reserved == 0 and tree.evictable_blocks == tree.num_blocks


def test_lpm_orders_by_cached_prefix_with_an_age_bound() -> None:
    now = [0.0]
    p = _policy(schedule_policy="lpm", lpm_max_wait_s=5.0, clock=lambda: now[0])
    shared = list(range(400, 424))
    p.add(_req("seed", shared + [1, 2]))
    _drain(p)
    p.max_running = 1
    old = _req("old", list(range(900, 930)))
    old.arrival = -1.0
    fresh = _req("fresh", shared + [3, 4])
    fresh.arrival = 0.0
    p.add(old)
    p.add(fresh)
    step = p.next_step()
    assert step.plan.new_rids == ("fresh",)  # longest cached prefix first
    _run(p, step)
    _drain(p)
    late = _req("late", list(range(700, 730)))
    late.arrival = 0.0
    hot = _req("hot", shared + [5, 6])
    hot.arrival = 1.0
    p.add(late)
    p.add(hot)
    now[0] = 5.5  # "late" waited past the bound, "hot" did not
    step = p.next_step()
    assert step.plan.new_rids == ("late",)
    _run(p, step)
    _drain(p)
    fcfs = _policy()
    for r in (_req("a", list(range(10, 40))), _req("b", shared)):
        fcfs.add(r)
    assert fcfs.next_step().plan.new_rids == ("a", "b")


def test_dp_groups_keep_their_own_trees_and_route_by_prefix() -> None:
    dp = DpSchedulePolicy(
        2,
        max_running_requests=4,
        max_total_tokens=40 * B,
        chunked_prefill_size=64,
        block_tokens=B,
        prefix_cache=lambda: RadixCache(B, snapshot_rows=4),
    )
    prompt = list(range(600, 640))
    dp.add(_req("a", prompt))
    busy = _req("busy", list(range(3000, 3010)), max_new=50)
    dp.add(busy)  # the least loaded: the other group
    assert dp.group_of == {"a": 0, "busy": 1}
    while dp.groups[0].has_work():
        step = dp.next_step()
        dp.cache_step(step.rows)
        for row in step.rows:
            if row.sample:
                row.req.output_ids.append(7)
                if row.req is not busy and len(row.req.output_ids) == row.req.max_new_tokens:
                    dp.release(row.req)
    trees = dp.prefix_caches
    assert trees[0].num_blocks == 5 and trees[1].num_blocks == 1  # "busy" crossed one edge
    dp.add(_req("b", prompt + [1]))
    assert dp.group_of["b"] == 0  # where its prefix is, although group 0 is not less loaded
    least = dp.pick_group()
    dp.add(_req("c", list(range(7000, 7020))))
    assert dp.group_of["c"] == least  # no prefix anywhere: the least loaded
    step = dp.next_step()
    assert step.plan.dp_plans[0].prefix_hits and not step.plan.dp_plans[1].prefix_hits


def test_a_request_longer_than_a_slot_holds_is_refused() -> None:
    """The pool rounds the budget up to whole blocks (at least one request's), but a request's
    table holds only the per-request capacity: admission must not promise more."""
    p = SchedulePolicy(
        max_running_requests=2,
        max_total_tokens=4 * B,
        chunked_prefill_size=64,
        block_tokens=B,
        max_request_tokens=20,
    )
    assert p.request_limit == 20
    assert p.can_ever_fit(_req("fits", range(15), max_new=5))
    assert not p.can_ever_fit(_req("long", range(15), max_new=6))


def _chat_hit_rate(chats: int, snapshots: int) -> float:
    """``bench_serving``'s multi-turn workload through the policy (answers of random tokens):
    cached tokens over reusable ones."""
    block = 256
    p = SchedulePolicy(
        max_running_requests=chats,
        max_total_tokens=10**6,
        chunked_prefill_size=8192,
        block_tokens=block,
        prefix_cache=RadixCache(block, snapshots),
    )
    convs = conversations(
        random.Random(0),
        num_conversations=chats,
        turns=6,
        system_len=1024,
        message_len=256,
        output_len=64,
        vocab_size=4000,
    )
    answers: list[list[tuple[list[int], str]]] = [[] for _ in convs]
    reusable: dict[str, int] = {}
    chat_of: dict[str, int] = {}
    rng = random.Random(1)

    def submit(i: int) -> None:
        turn = conversation_turn(convs[i], len(answers[i]), answers[i])
        rid = f"{i}-{len(answers[i])}"
        reusable[rid], chat_of[rid] = turn.reusable, i
        p.add(_req(rid, turn.input_ids, max_new=turn.output_len))

    for i in range(chats):
        submit(i)
    cached = 0
    while p.has_work():
        step = p.next_step()
        p.cache_step(step.rows)
        for row in step.rows:
            req = row.req
            if row.sample:
                req.output_ids.append(rng.randrange(16, 4000))
                if len(req.output_ids) == req.max_new_tokens:
                    p.release(req)
                    cached += req.cached_tokens
                    i = chat_of[req.rid]
                    answers[i].append((req.output_ids, ""))
                    if len(answers[i]) < 6:
                        submit(i)
    return cached / sum(reusable.values())


def test_the_multi_turn_workload_hits_its_reusable_tokens() -> None:
    default = _chat_hit_rate(16, snapshots=32)
    one_each = _chat_hit_rate(16, snapshots=16)
    print(f"hit of reusable tokens: {default:.1%} (2 snapshots a request), {one_each:.1%} (1)")
    assert default > 0.9 and one_each < default - 0.1


if __name__ == "__main__":
    run_this_file(__file__)
