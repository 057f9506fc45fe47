"""What runs next: continuous batching with chunked prefill under a token budget.

Each step takes, in order:
1. every running request whose prompt is in the cache: one decode token each;
2. running requests still prefilling: their next chunk, while the step's prefill budget
   (``--chunked-prefill-size`` tokens) lasts;
3. waiting requests, first come first served, while the running count stays under
   ``--max-running-requests``, their reservation (prompt + max new tokens) fits in what is left of
   ``--max-total-tokens``, and the prefill budget lasts. The head of the queue that does not fit
   blocks the rest (no starvation of long requests by short ones).

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

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.block_pool import blocks_for
from sglang.srt.model_executor.forward_plan import ForwardPlan


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
    ) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
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

    def reservation(self, req: Req) -> int:
        """The tokens ``req`` holds from admission to finish: whole blocks when paged."""
        return blocks_for(req.reserved_tokens, self.block_tokens) * self.block_tokens

    def can_ever_fit(self, req: Req) -> bool:
        return self.reservation(req) <= self.max_total_tokens

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
        self.reserved -= self.reservation(req)
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
                n = chunk_within_rows(req, want, rows_left - later)
                if n > 0:
                    budget -= n
                    rows_left -= self._take_chunk(req, n, take)
        new_rids: list[str] = []
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            req = self.waiting[0]
            if self.reserved + self.reservation(req) > self.max_total_tokens:
                break
            want = int(min(req.prompt_len, budget))
            n = chunk_within_rows(req, want, rows_left)
            if n == 0 < want:
                break  # no logit rows left for its first chunk: it leads the queue next step
            self.waiting.popleft()
            self.running.append(req)
            self.reserved += self.reservation(req)
            new_rids.append(req.rid)
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
        )
        return Step(plan, rows)

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


def chunk_within_rows(req: Req, n: int, rows_left: float) -> int:
    """The longest chunk of at most ``n`` tokens from ``req.prefilled`` that needs at most
    ``rows_left`` logit rows (0: none fits). Rows before ``logprob_start_len`` need none, so only
    a request with prompt log-probs or a completing sample row is ever shortened."""
    start = req.prefilled
    if chunk_logit_rows(req, start, n) <= rows_left:
        return n
    # Prompt log-prob rows grow one per token past logprob_start_len; the sample row adds one
    # at completion. So the longest fitting chunk is at most one past ``free + rows_left``.
    free = max(0, req.logprob_start_len - 1 - start) if req.wants_input_logprobs else n
    m = int(min(n, free + rows_left))
    while m > 0 and chunk_logit_rows(req, start, m) > rows_left:
        m -= 1
    return m
