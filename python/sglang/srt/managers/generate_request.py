"""One prompt as every endpoint hands it to the tokenizer manager, and how ``n`` choices of it
become requests of their own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from sglang.srt.constrained.grammar_spec import GrammarSpec
from sglang.srt.managers.request_error import RequestError
from sglang.srt.sampling.sampling_params import SEED_MAX, SamplingParams
from sglang.srt.sampling.thinking_budget import ReasoningControl

# Prompts x n of one HTTP request (or one Engine.generate call) at most: each is a request.
MAX_CHOICES = 1024


@dataclass
class GenerateRequest:
    """One prompt, as every endpoint hands it to :meth:`TokenizerManager.generate`."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    stream: bool = False
    rid: str | None = None
    # How the client names the output-length limit, for error messages.
    max_tokens_param: str = "max_new_tokens"
    # What the output must match; None: from the sampling params (json_schema / regex / ebnf).
    grammar: GrammarSpec | None = None
    # Set when the output starts inside the reasoning (thinking on): its end and budget.
    reasoning: ReasoningControl | None = None
    # Markup the decoded text keeps even where it is made of special tokens (for the parsers).
    keep_tokens: tuple[str, ...] = ()


def check_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise RequestError(
            f"{num_prompts} prompts x n={n} is {num_prompts * n} generations; one request takes "
            f"at most {MAX_CHOICES}: split it"
        )


def expand_n(req: GenerateRequest) -> list[GenerateRequest]:
    """``n`` choices of one prompt as ``n`` requests. With a seed, choice ``i`` samples with
    ``seed + i`` (modulo 2**64), so the choices differ and are reproducible."""
    p = req.sampling_params
    if p.n == 1:
        return [req]
    if req.rid is not None:
        raise RequestError("rid names one request; leave it out when n > 1")
    out = []
    for i in range(p.n):
        # torch reads a seed modulo 2**64, so this is seed + i as the generator sees it.
        seed = None if p.seed is None else (p.seed + i) % (SEED_MAX + 1)
        params = dataclasses.replace(p, n=1, seed=seed)
        out.append(dataclasses.replace(req, sampling_params=params))
    return out
