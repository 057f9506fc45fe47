"""The batch plan rank 0 broadcasts to every TP rank before each forward.

Each rank keeps its own per-request model caches keyed by request id; the plan says which caches
to drop (finished or aborted requests), which to create (admitted requests), and the rows of this
step: ``seq_lens[i]`` new tokens of request ``rids[i]`` (a prefill chunk, or one decode token).
Positions are not sent: every rank derives them from its cache lengths, which agree.

Under DP attention the plan carries one sub-plan per DP group (``dp_plans``; its own rows stay
empty): a rank applies its group's sub-plan, and every rank knows every group's token count
(``dp_num_tokens``, the sizes of the MoE's gathered buffer) and this step's padding
(``dp_padding``). A group with no rows still runs the step (collectives line up).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # DP attention: the groups' sub-plans, and "max_len" or "sum_len" (see layers/dp_attention).
    # Under DP, ``sample_rows`` index the groups' logits concatenated in group order.
    dp_plans: tuple[ForwardPlan, ...] = ()
    dp_padding: str = "sum_len"

    def __post_init__(self) -> None:
        if len(self.rids) != len(self.seq_lens):
            raise ValueError(f"{len(self.rids)} requests but {len(self.seq_lens)} lengths")
        if sum(self.seq_lens) != len(self.input_ids):
            raise ValueError(f"lengths sum to {sum(self.seq_lens)}, {len(self.input_ids)} ids")
        if self.dp_plans and self.rids:
            raise ValueError("a DP plan carries its rows in its sub-plans only")
        if self.dp_padding not in ("max_len", "sum_len"):
            raise ValueError(f"dp_padding must be max_len or sum_len, got {self.dp_padding!r}")

    @property
    def has_forward(self) -> bool:
        return bool(self.rids) or any(p.has_forward for p in self.dp_plans)

    @property
    def is_noop(self) -> bool:
        own = self.rids or self.new_rids or self.free_rids or self.shutdown
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
