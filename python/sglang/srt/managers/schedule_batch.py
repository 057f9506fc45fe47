"""A request as the scheduler (rank 0) tracks it: prompt, progress, outputs, budget share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sglang.srt.constrained.request_grammar import RequestGrammar
from sglang.srt.managers.io_struct import FinishReason, TokenizedGenerateReq
from sglang.srt.mem_cache.radix_cache import RadixNode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.sampling.thinking_budget import ReasoningTracker


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    # max_new_tokens after clamping to the context length (the scheduler's own limit).
    max_new_tokens: int
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens already in the model cache
    finish: FinishReason | None = None
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    input_logprobs_sent: bool = False
    arrival: float = field(default_factory=time.monotonic)  # when it was queued (lpm's age bound)
    # Prefix cache (none without one): prompt tokens the request resumed from, the tree node it
    # locks (the deepest of its path), how far its tokens are in the tree, the block edges where
    # a prefill chunk ends so a snapshot is taken there, and the node of the last snapshot it
    # saved that its next one supersedes (a chunk end inside the prompt, or while decoding).
    cached_tokens: int = 0
    prefix_node: RadixNode | None = None
    inserted_tokens: int = 0
    snapshot_cuts: list[int] = field(default_factory=list)
    passing_snapshot: RadixNode | None = None
    # Tokens of --max-total-tokens it holds on its own (whole blocks; the cached prefix and the
    # blocks it handed to the tree are the tree's), set on admission.
    reserved: int = 0
    grammar: RequestGrammar | None = None
    reasoning: ReasoningTracker | None = None

    @classmethod
    def from_message(cls, msg: TokenizedGenerateReq, max_new_tokens: int) -> Req:
        reasoning = None if msg.reasoning is None else ReasoningTracker(msg.reasoning)
        return cls(
            rid=msg.rid,
            input_ids=list(msg.input_ids),
            params=msg.sampling_params,
            max_new_tokens=max_new_tokens,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            logprob_start_len=msg.logprob_start_len,
            reasoning=reasoning,
        )

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def prompt_done(self) -> bool:
        return self.prefilled >= self.prompt_len

    @property
    def reserved_tokens(self) -> int:
        """Its share of --max-total-tokens, held from admission to finish: the most tokens its
        cache can ever hold."""
        return self.prompt_len + self.max_new_tokens

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def prefix_limit(self) -> int:
        """The longest cached prefix it can start from: the last prompt token is always
        computed (its logits give the first output), and so is every token whose prompt
        log-prob it asked for (row ``j`` gives token ``j + 1``'s)."""
        limit = self.prompt_len - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(0, self.logprob_start_len - 1))
        return limit

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end - 1`` of its cache (the prompt, then the outputs fed back)."""
        p = self.prompt_len
        head = self.input_ids[start:end] if start < p else []
        return head + self.output_ids[max(start, p) - p : max(end, p) - p]
