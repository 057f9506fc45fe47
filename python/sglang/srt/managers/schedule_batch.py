"""A request as the scheduler (rank 0) tracks it: prompt, progress, outputs, budget share."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang.srt.constrained.request_grammar import RequestGrammar
from sglang.srt.managers.io_struct import FinishReason, TokenizedGenerateReq
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
