"""The batch plan rank 0 broadcasts to every TP rank before each forward.

Each rank keeps its own per-request model caches keyed by request id; the plan says which caches
to drop (finished or aborted requests), which to create (admitted requests), and the rows of this
step: ``seq_lens[i]`` new tokens of request ``rids[i]`` (a prefill chunk, or one decode token).
Positions are not sent: every rank derives them from its cache lengths, which agree.

Under DP attention the plan carries one sub-plan per DP group (``dp_plans``; its own rows stay
empty): a rank applies its group's sub-plan, and every rank knows every group's token count
(``dp_num_tokens``, the sizes of the MoE's gathered buffer) and this step's padding
(``dp_padding``). A group with no rows still runs the step (collectives line up).

The forward returns logits only for ``logit_rows`` (every row when ``None``): each sampled
request's last row and the prompt rows whose log-probs were asked for. The final norm and LM head
are per-token, so the other rows are dropped before them; a prefill chunk of 8192 tokens would
otherwise make ``8192 x V`` fp32 logits of which one row is read. :attr:`ForwardPlan.output_rows`
says which batch row each returned row is.

With the prefix cache, ``cache_ops`` change what every rank's prefix store holds (applied first,
in order, before the frees: a finished request still hands its blocks to the tree), and
``prefix_hits`` start new requests from a cached prefix (applied once their caches exist).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from itertools import pairwise

from sglang.srt.mem_cache.radix_ops import CacheOp, PrefixHit


@dataclass(frozen=True)
class ForwardPlan:
    rids: tuple[str, ...] = ()
    seq_lens: tuple[int, ...] = ()
    input_ids: tuple[int, ...] = ()
    new_rids: tuple[str, ...] = ()
    free_rids: tuple[str, ...] = ()
    shutdown: bool = False
    # Rows whose logits rank 0 samples from (the last row of each request that samples this step).
    sample_rows: tuple[int, ...] = field(default=(), compare=False)
    # Rows whose logits the forward returns, ascending (None: every row). Under DP each group's
    # sub-plan carries its own (the top-level plan leaves it None).
    logit_rows: tuple[int, ...] | None = field(default=None, compare=False)
    # DP attention: the groups' sub-plans, and "max_len" or "sum_len" (see layers/dp_attention).
    # Under DP, ``sample_rows`` index the groups' logits concatenated in group order.
    dp_plans: tuple[ForwardPlan, ...] = ()
    dp_padding: str = "sum_len"
    # Prefix cache (see the module doc); under DP each group's sub-plan carries its own.
    cache_ops: tuple[CacheOp, ...] = ()
    prefix_hits: tuple[PrefixHit, ...] = ()

    def __post_init__(self) -> None:
        if len(self.rids) != len(self.seq_lens):
            raise ValueError(f"{len(self.rids)} requests but {len(self.seq_lens)} lengths")
        if sum(self.seq_lens) != len(self.input_ids):
            raise ValueError(f"lengths sum to {sum(self.seq_lens)}, {len(self.input_ids)} ids")
        if self.dp_plans and (self.rids or self.cache_ops or self.prefix_hits):
            raise ValueError("a DP plan carries its rows and cache changes in its sub-plans only")
        stray = {h.rid for h in self.prefix_hits} - set(self.new_rids)
        if stray:
            raise ValueError(f"prefix hits for requests that are not new: {sorted(stray)[:4]}")
        if self.dp_padding not in ("max_len", "sum_len"):
            raise ValueError(f"dp_padding must be max_len or sum_len, got {self.dp_padding!r}")
        if self.logit_rows is not None:
            self._check_logit_rows(self.logit_rows)

    def _check_logit_rows(self, rows: tuple[int, ...]) -> None:
        if self.dp_plans:
            raise ValueError("a DP plan carries logit_rows in its sub-plans only")
        if rows and (rows[0] < 0 or rows[-1] >= self.num_tokens):
            raise ValueError(f"logit_rows must lie in [0, {self.num_tokens}), got {rows[0]}..")
        if any(a >= b for a, b in pairwise(rows)):
            raise ValueError("logit_rows must be strictly ascending")
        missing = set(self.sample_rows) - set(rows)
        if missing:
            raise ValueError(f"sampled rows {sorted(missing)[:8]} are not in logit_rows")

    @property
    def has_forward(self) -> bool:
        return bool(self.rids) or any(p.has_forward for p in self.dp_plans)

    @property
    def is_noop(self) -> bool:
        own = self.rids or self.new_rids or self.free_rids or self.shutdown or self.cache_ops
        return not own and all(p.is_noop for p in self.dp_plans)

    @property
    def dp_num_tokens(self) -> tuple[int, ...]:
        """Tokens of each DP group this step (empty without DP attention)."""
        return tuple(p.num_tokens for p in self.dp_plans)

    def for_dp_rank(self, dp_rank: int) -> ForwardPlan:
        """The rows, new and freed caches of one DP group (the plan itself without DP)."""
        return self.dp_plans[dp_rank] if self.dp_plans else self

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @cached_property  # read twice a step; the plan is frozen
    def output_rows(self) -> tuple[int, ...]:
        """The batch row of each row the forward returns, in order. Under DP: every group's, as
        rows of the groups' batches concatenated in group order (what reaches rank 0)."""
        if not self.dp_plans:
            if self.logit_rows is None:
                return tuple(range(self.num_tokens))
            return self.logit_rows
        rows: list[int] = []
        offset = 0
        for sub in self.dp_plans:
            rows.extend(offset + r for r in sub.output_rows)
            offset += sub.num_tokens
        return tuple(rows)

    @property
    def prunes_logits(self) -> bool:
        """The forward returns fewer rows than it runs (this plan's own rows, not DP's)."""
        return self.logit_rows is not None and len(self.logit_rows) < self.num_tokens
