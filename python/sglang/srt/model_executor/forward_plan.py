"""The batch plan rank 0 broadcasts to every TP rank before each forward.

Each rank keeps its own per-request model caches keyed by request id; the plan says which caches
to drop (finished or aborted requests), which to create (admitted requests), and the rows of this
step: ``seq_lens[i]`` new tokens of request ``rids[i]`` (a prefill chunk, or one decode token).
Positions are not sent: every rank derives them from its cache lengths, which agree.
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

    def __post_init__(self) -> None:
        if len(self.rids) != len(self.seq_lens):
            raise ValueError(f"{len(self.rids)} requests but {len(self.seq_lens)} lengths")
        if sum(self.seq_lens) != len(self.input_ids):
            raise ValueError(f"lengths sum to {sum(self.seq_lens)}, {len(self.input_ids)} ids")

    @property
    def has_forward(self) -> bool:
        return bool(self.rids)

    @property
    def is_noop(self) -> bool:
        return not (self.rids or self.new_rids or self.free_rids or self.shutdown)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
