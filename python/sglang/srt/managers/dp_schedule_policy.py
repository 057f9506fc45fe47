"""Scheduling under DP attention: one :class:`SchedulePolicy` per DP group behind the same
interface, so rank 0's scheduler loop does not branch on DP.

A new request goes to the least-loaded group (fewest requests, then fewest reserved tokens, then the
lowest index) and stays there: its cache lives on that group's ranks. With the prefix cache every
group has its own tree (its ranks hold its blocks), and a request goes to the group that can resume
it from the longest cached prefix, unless that group already runs and queues
``max_running_requests`` more requests than the least loaded one (then balance wins). Every group
has the whole per-rank budget (``--max-total-tokens``, ``--max-running-requests``), since its ranks
hold only its own caches. A step is every group's step at once: one :class:`ForwardPlan` whose
``dp_plans`` are the groups' plans (an idle group's is empty, and it still runs the step) and whose
padding mode is chosen from the groups' token counts. Rows and ``sample_rows`` index the groups'
rows concatenated in group order. Each group's sub-plan carries its own ``logit_rows`` (at most
``max_logit_rows`` of them: the cap holds per group, as each group's ranks compute their own); the
gather to rank 0 brings those rows, in the order of the plan's ``output_rows``.
"""

from __future__ import annotations

from collections.abc import Callable

from sglang.srt.layers.dp_attention import choose_dp_padding
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import SchedulePolicy, Step, StepRow
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_plan import ForwardPlan

BALANCE_POLICY = "least-loaded (fewest requests, then fewest reserved tokens)"
PREFIX_POLICY = "to the longest cached prefix, else least-loaded"


class DpSchedulePolicy:
    def __init__(
        self,
        dp_size: int,
        *,
        max_running_requests: int,
        max_total_tokens: int,
        chunked_prefill_size: int,
        max_logit_rows: int | None = None,
        block_tokens: int = 1,
        prefix_cache: Callable[[], RadixCache] | None = None,
        schedule_policy: str = "fcfs",
        max_request_tokens: int | None = None,
    ) -> None:
        """``prefix_cache`` makes each group's tree (None: no prefix cache)."""
        if dp_size < 2:
            raise ValueError(f"DP scheduling needs at least 2 groups, got {dp_size}")
        self.groups = [
            SchedulePolicy(
                max_running_requests=max_running_requests,
                max_total_tokens=max_total_tokens,
                chunked_prefill_size=chunked_prefill_size,
                max_logit_rows=max_logit_rows,
                block_tokens=block_tokens,
                prefix_cache=None if prefix_cache is None else prefix_cache(),
                schedule_policy=schedule_policy,
                max_request_tokens=max_request_tokens,
            )
            for _ in range(dp_size)
        ]
        self.max_running = max_running_requests
        self.max_total_tokens = max_total_tokens
        self.group_of: dict[str, int] = {}

    # --- what the scheduler reads ----------------------------------------------------------------

    @property
    def running(self) -> list[Req]:
        return [req for g in self.groups for req in g.running]

    @property
    def waiting(self) -> list[Req]:
        return [req for g in self.groups for req in g.waiting]

    @property
    def reserved(self) -> int:
        return sum(g.reserved for g in self.groups)

    @property
    def cached_cache_tokens(self) -> int:
        return sum(g.cached_cache_tokens for g in self.groups)

    @property
    def prompt_tokens(self) -> int:
        return sum(g.prompt_tokens for g in self.groups)

    @property
    def cached_tokens(self) -> int:
        return sum(g.cached_tokens for g in self.groups)

    @property
    def prefix_caches(self) -> list[RadixCache]:
        return [g.prefix_cache for g in self.groups if g.prefix_cache is not None]

    def has_work(self) -> bool:
        return any(g.has_work() for g in self.groups)

    # --- queue changes -------------------------------------------------------------------------

    def can_ever_fit(self, req: Req) -> bool:
        return self.groups[0].can_ever_fit(req)

    @property
    def request_limit(self) -> int:
        return self.groups[0].request_limit

    def pick_group(self, req: Req | None = None) -> int:
        def load(i: int) -> tuple[int, int, int]:
            g = self.groups[i]
            queued = sum(r.reserved_tokens for r in g.waiting)
            return (len(g.running) + len(g.waiting), g.reserved + queued, i)

        least = min(range(len(self.groups)), key=load)
        if req is None:
            return least
        cached = [
            0
            if g.prefix_cache is None
            else g.prefix_cache.match(req.input_ids, req.prefix_limit).cached_tokens
            for g in self.groups
        ]
        best = max(range(len(self.groups)), key=lambda i: (cached[i], -i))
        if cached[best] == 0 or load(best)[0] - load(least)[0] > self.max_running:
            return least
        return best

    def add(self, req: Req) -> None:
        group = self.pick_group(req)
        self.group_of[req.rid] = group
        self.groups[group].add(req)

    def remove(self, rid: str) -> Req | None:
        group = self.group_of.pop(rid, None)
        return None if group is None else self.groups[group].remove(rid)

    def release(self, req: Req) -> None:
        self.groups[self.group_of.pop(req.rid)].release(req)

    def cache_step(self, rows: list[StepRow]) -> None:
        """Each row's group caches what the step left in its request's cache."""
        for i, group in enumerate(self.groups):
            group.cache_step([r for r in rows if self.group_of.get(r.req.rid) == i])

    # --- the next step -------------------------------------------------------------------------

    def next_step(self) -> Step:
        steps = [g.next_step() for g in self.groups]
        rows: list[StepRow] = []
        sample_rows: list[int] = []
        offset = 0
        for step in steps:
            for r in step.rows:
                rows.append(StepRow(r.req, offset + r.start, r.length, r.prompt_pos, r.sample))
            sample_rows.extend(offset + i for i in step.plan.sample_rows)
            offset += step.plan.num_tokens
        plans = tuple(s.plan for s in steps)
        padding = choose_dp_padding([p.num_tokens for p in plans])
        plan = ForwardPlan(dp_plans=plans, sample_rows=tuple(sample_rows), dp_padding=padding.value)
        return Step(plan, rows)
