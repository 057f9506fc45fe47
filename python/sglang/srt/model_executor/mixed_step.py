"""A mixed step (decode rows and prefill chunks in one plan) split in two forwards: the decode
rows through the static decode (a graph replay where one is captured), the prefill chunks
eagerly.

Run as one eager forward, a mixed step walks every decode row's cache per request in Python
(tens of launches each, per layer) where a graph replay runs them all as one; under a steady
stream of arrivals most steps are mixed, so decode would leave its graphs most of the time. A row
is a decode row when it is one token of a request whose cache already holds tokens; the others
(prefill chunks, a first token) run eagerly. The logits come back in the plan's output order.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from sglang.srt.model_executor.forward_plan import ForwardPlan


@dataclass(frozen=True)
class MixedSplit:
    decode: tuple[int, ...]  # requests (plan indices) whose one row goes to the static decode
    eager: tuple[int, ...]  # requests run eagerly, in plan order
    decode_ids: tuple[int, ...]
    eager_ids: tuple[int, ...]
    eager_lens: tuple[int, ...]
    # Rows of the eager sub-batch whose logits are returned (ascending), None: every row.
    eager_logit_rows: tuple[int, ...] | None
    # For each output row of the plan: its row in cat([decode logits, eager logits]).
    order: tuple[int, ...]


def split_mixed_step(plan: ForwardPlan, cache_lens: Sequence[int]) -> MixedSplit | None:
    """The split of ``plan`` (its requests' caches hold ``cache_lens`` tokens), or None when it
    has no decode row or nothing else."""
    lens = plan.seq_lens
    decode = tuple(i for i, n in enumerate(lens) if n == 1 and cache_lens[i] > 0)
    if not decode or len(decode) == len(lens):
        return None
    decode_index = {i: j for j, i in enumerate(decode)}
    eager = tuple(i for i in range(len(lens)) if i not in decode_index)
    starts = list(accumulate(lens, initial=0))
    eager_start = dict(zip(eager, accumulate((lens[i] for i in eager), initial=0)))
    # Per output row (a few per request, not every prefill token): its request by bisection,
    # then its row in the decode logits or in the eager sub-batch.
    where: list[tuple[bool, int]] = []
    for r in plan.output_rows:
        i = bisect_right(starts, r) - 1
        if i in decode_index:
            where.append((True, decode_index[i]))
        else:
            where.append((False, eager_start[i] + r - starts[i]))
    wanted = [row for is_dec, row in where if not is_dec]
    every = len(wanted) == sum(lens[i] for i in eager)
    # The eager forward returns its wanted rows in order, after the decode logits.
    order, taken = [], 0
    for is_dec, row in where:
        order.append(row if is_dec else len(decode) + taken)
        taken += not is_dec
    return MixedSplit(
        decode=decode,
        eager=eager,
        decode_ids=tuple(plan.input_ids[starts[i]] for i in decode),
        eager_ids=tuple(t for i in eager for t in plan.input_ids[starts[i] : starts[i + 1]]),
        eager_lens=tuple(lens[i] for i in eager),
        eager_logit_rows=None if every else tuple(wanted),
        order=tuple(order),
    )
