"""What runs next: continuous batching with chunked prefill under a token budget.

Each step takes, in order:
1. every running request whose prompt is in the cache: one decode token each;
2. running requests still prefilling: their next chunk, while the step's prefill budget
   (``--chunked-prefill-size`` tokens) lasts;
3. waiting requests, while the running count stays under ``--max-running-requests``, their
   reservation (prompt + max new tokens) fits in what is left of ``--max-total-tokens``, and the
   prefill budget lasts. The head of the queue that does not fit blocks the rest (no starvation
   of long requests by short ones). The queue's order is ``--schedule-policy``: ``fcfs`` (first
   come, first served) or ``lpm`` (longest cached prefix first, as SGLang's; requests that waited
   ``SGLANG_LPM_MAX_WAIT_S`` or more go first, in arrival order, so none starves; fcfs beyond
   ``LPM_MAX_QUEUE`` waiting requests, where matching every one each step would cost too much).

With the prefix cache (``RadixCache``, ``--disable-radix-cache`` turns it off) a request starts
from the longest cached prefix it can resume from: those tokens are neither computed nor
reserved (the tree holds their blocks), and its prefill starts mid-prompt. Cached blocks nobody
runs on are evictable: when the pool is short for the next request, the least recently used are
dropped before it is made to wait. The request's own blocks go to the tree at every block edge
its cache reaches at the end of a step (a prefill chunk that ends on one, a decode crossing one),
with a snapshot of its state there: a prefill chunk is ended at the last block edge of the prompt
and where its tokens leave the tree's (a branch point), so those edges get one. Of the snapshots
a request saves at other edges only the latest stays, unless another request resumed from one.

With paged caches (``block_tokens > 1``: the static decode's block pool) a reservation is whole
blocks, ``ceil((prompt + max new) / block_tokens)`` of them, and ``max_total_tokens`` is the pool's
blocks: admission by free blocks. A request reserves every block it can ever fill, so a running
request never runs out of blocks mid-decode (no retraction is needed; a request that does not
fit waits in the queue until finished ones return theirs).

With ``max_logit_rows`` (``--max-logit-rows-per-step``) a step's logit rows (one per sampling
request, plus the prompt rows of a request that asked for prompt log-probs) stay within the cap:
a prefill chunk that would need more rows than are left is shortened and continues next step (a
request is never dropped). Every step can still serve each running request: decodes and the
sample row that completes a prompt need one row each, and the cap is at least
``--max-running-requests`` (checked at startup); a running prefill leaves one row for each
running prefill after it. A waiting request whose chunk gets no rows at all
waits for the next step (first come, first served, as for the other budgets).

Finished and aborted requests return their reservation at once; their caches are dropped on every
rank with the next plan.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.block_pool import blocks_for
from sglang.srt.mem_cache.radix_cache import PrefixMatch, RadixCache
from sglang.srt.mem_cache.radix_ops import PrefixHit
from sglang.srt.model_executor.forward_plan import ForwardPlan

SCHEDULE_POLICIES = ("fcfs", "lpm")
# lpm matches every waiting request against the tree each step; past this many it is fcfs.
LPM_MAX_QUEUE = 128


@dataclass
class StepRow:
    """One request's rows in the plan: ``start`` in the batch, ``length`` tokens, and whether
    its last row is sampled (prompt completed or decode)."""

    req: Req
    start: int
    length: int
    prompt_pos: int  # first position of these rows
    sample: bool

    @property
    def last(self) -> int:
        return self.start + self.length - 1

    @property
    def cache_len(self) -> int:
        """Tokens in the request's cache after the step."""
        return self.prompt_pos + self.length

    @property
    def logprob_rows(self) -> range:
        """The rows whose logits give the prompt's log-probs the request asked for: row
        ``start + j`` predicts prompt token ``prompt_pos + j + 1``, and tokens from
        ``logprob_start_len`` on are returned (the first token has none)."""
        req = self.req
        if not req.wants_input_logprobs or self.prompt_pos >= req.prompt_len:
            return range(0)  # no prompt log-probs asked for, or a decode row
        first = max(0, req.logprob_start_len - 1 - self.prompt_pos)
        n_pred = min(self.length, req.prompt_len - 1 - self.prompt_pos)
        return range(self.start + first, self.start + max(first, n_pred))

    def logit_rows(self) -> list[int]:
        """The rows of this request whose logits the step needs, ascending."""
        rows = list(self.logprob_rows)
        if self.sample and (not rows or rows[-1] != self.last):
            rows.append(self.last)
        return rows


@dataclass
class Step:
    plan: ForwardPlan
    rows: list[StepRow] = field(default_factory=list)


class SchedulePolicy:
    def __init__(
        self,
        *,
        max_running_requests: int,
        max_total_tokens: int,
        chunked_prefill_size: int,
        block_tokens: int = 1,
        max_logit_rows: int | None = None,
        prefix_cache: RadixCache | None = None,
        schedule_policy: str = "fcfs",
        lpm_max_wait_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        max_request_tokens: int | None = None,
    ) -> None:
        """``max_request_tokens``: the most one request may hold (the slot pool's per-request
        capacity; None: only the budget bounds it)."""
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        if schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule policy must be one of {SCHEDULE_POLICIES}, got {schedule_policy!r}"
            )
        if prefix_cache is not None and prefix_cache.block_tokens != block_tokens:
            raise ValueError(
                f"the prefix cache's blocks ({prefix_cache.block_tokens} tokens) must be the "
                f"pool's ({block_tokens})"
            )
        self.prefix_cache = prefix_cache
        self.max_request_tokens = max_request_tokens
        self.schedule_policy = schedule_policy
        self.lpm_max_wait_s = lpm_max_wait_s
        self.clock = clock
        # Admitted prompt tokens and the cached ones among them (hit rate), since start.
        self.prompt_tokens = 0
        self.cached_tokens = 0
        if max_logit_rows is not None and max_logit_rows < max_running_requests:
            raise ValueError(
                f"max_logit_rows {max_logit_rows} is below max_running_requests "
                f"{max_running_requests}: a decode step needs one logit row per running request"
            )
        # None: no cap (every row a step needs gets logits).
        self.max_logit_rows = max_logit_rows
        self.max_running = max_running_requests
        self.max_total_tokens = max_total_tokens
        self.block_tokens = block_tokens
        # <= 0: no chunking (whole prompts, however long).
        self.chunk = chunked_prefill_size if chunked_prefill_size > 0 else None
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reserved = 0
        self.pending_free: list[str] = []
        self.num_cached = 0  # caches that exist on the ranks (created and not yet freed)

    # --- queue changes -------------------------------------------------------------------------

    def reservation(self, req: Req, cached: int = 0) -> int:
        """The tokens ``req`` holds from admission to finish (whole blocks when paged), less a
        cached prefix of ``cached`` tokens (whole blocks) the tree holds for it."""
        return blocks_for(req.reserved_tokens, self.block_tokens) * self.block_tokens - cached

    @property
    def cached_cache_tokens(self) -> int:
        """Tokens of --max-total-tokens the prefix cache's blocks hold."""
        cache = self.prefix_cache
        return 0 if cache is None else cache.num_blocks * self.block_tokens

    @property
    def request_limit(self) -> int:
        """The most tokens (prompt + max new) one request may hold."""
        if self.max_request_tokens is None:
            return self.max_total_tokens
        return min(self.max_total_tokens, self.max_request_tokens)

    def can_ever_fit(self, req: Req) -> bool:
        return req.reserved_tokens <= self.request_limit and (
            self.reservation(req) <= self.max_total_tokens
        )

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def remove(self, rid: str) -> Req | None:
        """Take a request out (abort); returns it, or ``None`` if unknown or already done."""
        for i, req in enumerate(self.waiting):
            if req.rid == rid:
                del self.waiting[i]
                return req
        for req in self.running:
            if req.rid == rid:
                self.release(req)
                return req
        return None

    def release(self, req: Req) -> None:
        """A running request is finished: return its reservation, drop its cache next step."""
        self.running.remove(req)
        self.reserved -= req.reserved
        req.reserved = 0
        if self.prefix_cache is not None:
            self.prefix_cache.unlock(req.prefix_node)
            req.prefix_node = None
        self.pending_free.append(req.rid)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.pending_free)

    # --- the next step -------------------------------------------------------------------------

    def next_step(self) -> Step:
        ids: list[int] = []
        rids: list[str] = []
        lens: list[int] = []
        rows: list[StepRow] = []

        def take(req: Req, tokens: list[int], pos: int, sample: bool) -> None:
            rows.append(StepRow(req, len(ids), len(tokens), pos, sample))
            rids.append(req.rid)
            lens.append(len(tokens))
            ids.extend(tokens)

        for req in self.running:
            if req.prompt_done:
                take(req, [req.output_ids[-1]], req.prompt_len + len(req.output_ids) - 1, True)
        budget = self.chunk if self.chunk is not None else float("inf")
        # Logit rows left this step; the decodes above took one each.
        rows_left = float("inf") if self.max_logit_rows is None else self.max_logit_rows - len(rows)
        prefilling = [req for req in self.running if not req.prompt_done]
        for i, req in enumerate(prefilling):
            if budget > 0:
                # Keep a row for each later prefill's sample row, so a prompt log-prob request
                # does not hold the others back (running <= cap leaves this one at least one).
                later = len(prefilling) - 1 - i
                want = int(min(req.prompt_len - req.prefilled, budget))
                n = self._cut(req, chunk_within_rows(req, want, rows_left - later))
                if n > 0:
                    budget -= n
                    rows_left -= self._take_chunk(req, n, take)
        new_rids: list[str] = []
        hits: list[PrefixHit] = []
        for req in self._admission_order():
            if len(self.running) >= self.max_running or budget <= 0:
                break
            match = self._match(req)
            start = match.cached_tokens
            want = int(min(req.prompt_len - start, budget))
            n = chunk_within_rows(req, want, rows_left, start=start)
            if n == 0 < want:
                break  # no logit rows left for its first chunk: it leads the queue next step
            if not self._admit(req, match):
                break
            del self.waiting[next(i for i, r in enumerate(self.waiting) if r is req)]
            self.running.append(req)
            new_rids.append(req.rid)
            hit = match.hit(req.rid)
            if hit is not None:
                hits.append(hit)
            n = self._cut(req, n)
            budget -= n
            rows_left -= self._take_chunk(req, n, take)
        free, self.pending_free = self.pending_free, []
        self.num_cached += len(new_rids) - len(free)
        plan = ForwardPlan(
            rids=tuple(rids),
            seq_lens=tuple(lens),
            input_ids=tuple(ids),
            new_rids=tuple(new_rids),
            free_rids=tuple(free),
            sample_rows=tuple(r.last for r in rows if r.sample),
            logit_rows=tuple(i for r in rows for i in r.logit_rows()),
            cache_ops=() if self.prefix_cache is None else self.prefix_cache.take_ops(),
            prefix_hits=tuple(hits),
        )
        return Step(plan, rows)

    # --- the prefix cache ---------------------------------------------------------------------

    def _admission_order(self) -> list[Req]:
        """The waiting requests in the order they are offered admission (see the module doc)."""
        waiting = list(self.waiting)
        cache = self.prefix_cache
        if self.schedule_policy == "fcfs" or cache is None or len(waiting) > LPM_MAX_QUEUE:
            return waiting
        now = self.clock()
        aged = [r for r in waiting if now - r.arrival >= self.lpm_max_wait_s]
        fresh = [r for r in waiting if now - r.arrival < self.lpm_max_wait_s]

        def longest_first(req: Req) -> tuple[int, int]:
            m = cache.match(req.input_ids, req.prefix_limit)
            return (-m.cached_tokens, -m.matched_tokens)

        return aged + sorted(fresh, key=longest_first)  # stable: arrival order among equals

    def _match(self, req: Req) -> PrefixMatch:
        if self.prefix_cache is None:
            return PrefixMatch((), 0, 0)
        return self.prefix_cache.match(req.input_ids, req.prefix_limit)

    def _admit(self, req: Req, match: PrefixMatch) -> bool:
        """Reserve ``req``'s own blocks (the cached prefix is the tree's), evicting unlocked
        cached blocks if the pool is short; False (nothing changed): it waits."""
        cache = self.prefix_cache
        node = match.nodes[-1] if match.nodes else None
        if cache is not None:
            cache.lock(node)  # before making room: its own prefix is not evictable
        need = self.reservation(req, match.cached_tokens)
        short = self.reserved + self.cached_cache_tokens + need - self.max_total_tokens
        if short > 0:
            blocks = blocks_for(short, self.block_tokens)
            if cache is None or cache.evictable_blocks < blocks:
                if cache is not None:
                    cache.unlock(node)
                return False
            cache.evict(blocks)
        req.reserved = need
        self.reserved += need
        req.prefilled = req.cached_tokens = req.inserted_tokens = match.cached_tokens
        req.prefix_node = node
        if node is not None:
            node.hits += 1
        self.prompt_tokens += req.prompt_len
        self.cached_tokens += match.cached_tokens
        if cache is not None:
            # Snapshots where other requests would resume: the branch point (the tree's blocks
            # go on past what it can resume from) and the prompt's last block edge.
            last_edge = req.prompt_len // self.block_tokens * self.block_tokens
            cuts = {match.matched_tokens, last_edge} - {req.prompt_len}
            req.snapshot_cuts = sorted(c for c in cuts if c > match.cached_tokens)
        return True

    def _cut(self, req: Req, n: int) -> int:
        """``n`` prompt tokens from ``req.prefilled``, ended at its next snapshot edge."""
        start = req.prefilled
        for cut in req.snapshot_cuts:
            if start < cut < start + n:
                return cut - start
        return n

    def cache_step(self, rows: list[StepRow]) -> None:
        """After a step ran: every request whose cache now ends on a block edge past what the
        tree has of it hands the tree its blocks and a snapshot of its state there (applied by
        the ranks with the next plan, before that plan's frees). Call before releasing the
        requests that finished in the step."""
        cache = self.prefix_cache
        if cache is None:
            return
        for row in rows:
            req, end = row.req, row.cache_len
            if end % self.block_tokens or end <= req.inserted_tokens:
                continue
            start = req.inserted_tokens  # where the path it holds ends
            done = cache.insert(
                req.tokens_between(start, end),
                req.rid,
                held=req.prefix_node,
                start=start,
                snapshot=True,
            )
            req.prefix_node, req.inserted_tokens = done.node, end
            moved = done.new_blocks * self.block_tokens  # its own blocks, now the tree's
            req.reserved -= moved
            self.reserved -= moved
            if not done.saved_now:
                continue
            # A snapshot this request saved at a chunk end inside its prompt or while decoding
            # is superseded by the next one it saves on the same path: dropped, unless another
            # request resumed from it meanwhile. Its prompt's last edge and a branch point stay
            # (where a retry or the next request sharing that prefix resumes).
            old = req.passing_snapshot
            if old is not None and old.hits == 0:
                cache.drop_snapshot(old)
            kept = end in req.snapshot_cuts or end == req.prompt_len
            req.passing_snapshot = None if kept else done.node

    @staticmethod
    def _take_chunk(req: Req, n: int, take: Callable[[Req, list[int], int, bool], None]) -> int:
        """Prefill the next ``n`` prompt tokens of ``req``; returns the logit rows they need."""
        start = req.prefilled
        take(req, req.input_ids[start : start + n], start, chunk_samples(req, start, n))
        req.prefilled += n
        return chunk_logit_rows(req, start, n)


def chunk_samples(req: Req, start: int, n: int) -> bool:
    """Whether a chunk of ``n`` prompt tokens from ``start`` samples: it completes the prompt (a
    request with max_new_tokens == 0 completes it without sampling)."""
    return start + n == req.prompt_len and req.max_new_tokens > 0


def chunk_logit_rows(req: Req, start: int, n: int) -> int:
    """The logit rows a chunk of ``n`` prompt tokens from ``start`` needs: its prompt log-prob
    rows (as :attr:`StepRow.logprob_rows` counts them) and the sampled last row."""
    row = StepRow(req, 0, n, start, chunk_samples(req, start, n))
    return len(row.logit_rows())


def chunk_within_rows(req: Req, n: int, rows_left: float, start: int | None = None) -> int:
    """The longest chunk of at most ``n`` tokens from ``start`` (default ``req.prefilled``) that
    needs at most ``rows_left`` logit rows (0: none fits). Rows before ``logprob_start_len`` need
    none, so only a request with prompt log-probs or a completing sample row is ever shortened."""
    start = req.prefilled if start is None else start
    if chunk_logit_rows(req, start, n) <= rows_left:
        return n
    # Prompt log-prob rows grow one per token past logprob_start_len; the sample row adds one
    # at completion. So the longest fitting chunk is at most one past ``free + rows_left``.
    free = max(0, req.logprob_start_len - 1 - start) if req.wants_input_logprobs else n
    m = int(min(n, free + rows_left))
    while m > 0 and chunk_logit_rows(req, start, m) > rows_left:
        m -= 1
    return m
