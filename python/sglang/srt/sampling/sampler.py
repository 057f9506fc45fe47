"""Token selection for one batch of rows: penalties, greedy or temperature / top-k / top-p /
min-p sampling, and log-probabilities.

Random draws use the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``), which samples exactly
from ``p``, one row at a time from that row's generator: a request with a ``seed`` gets the same
tokens whatever else shares its batch. Log-probabilities are those of the model's distribution
(raw logits, before penalties and temperature), as SGLang reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang.srt.sampling.penalties import apply_penalties_
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.sampling.token_bitmask import apply_token_bitmask_


@dataclass
class SamplingRow:
    """One row of logits and what its request asks for."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # The token this row must produce (a spent thinking budget ends the reasoning), if any.
    forced_token: int | None = None


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def _filter_sorted_(
    sorted_probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> None:
    """Zero the probabilities (sorted descending per row) that top-k, top-p or min-p drop.
    The most likely token always survives."""
    vocab = sorted_probs.shape[-1]
    rank = torch.arange(vocab, device=sorted_probs.device).unsqueeze(0)
    drop = rank >= top_k.unsqueeze(1)
    # Keep a token while the mass strictly before it is below top_p.
    before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= before >= top_p.unsqueeze(1)
    drop |= sorted_probs < (min_p * sorted_probs[:, 0]).unsqueeze(1)
    drop[:, 0] = False
    sorted_probs.masked_fill_(drop, 0.0)


def _exponential_noise(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """One row of Exp(1) noise per row of ``probs``, each drawn from that row's generator (so a
    seeded request samples the same tokens whatever it is batched with)."""
    return torch.stack(
        [torch.empty_like(row).exponential_(generator=g) for row, g in zip(probs, generators)]
    )


def _apply_logit_bias_(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> None:
    """Add OpenAI-style biases to one row; ids past this row's vocabulary are ignored."""
    pairs = [(t, b) for t, b in bias if t < logits.shape[-1]]
    if pairs:
        idx = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=logits.device)
        logits[idx] += torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)


def sample(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    default_generator: torch.Generator | None,
    token_bitmask: torch.Tensor | None = None,
) -> SampleOutput:
    """``logits [B, V]`` (fp32) -> one token per row. ``token_bitmask [B, ceil(V/32)]`` (int32,
    on the host) masks the rows' grammars; it is applied on the logits' device, in place."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
    logits = logits.float()
    want_lp = any(r.return_logprob for r in rows)
    raw_lp = torch.log_softmax(logits, dim=-1) if want_lp else None

    if any(r.params.has_penalties or r.params.logit_bias for r in rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.params.has_penalties:
                apply_penalties_(logits[i], r.params, r.prompt_ids, r.output_ids)
            if r.params.logit_bias:
                _apply_logit_bias_(logits[i], r.params.logit_bias)

    if token_bitmask is not None:
        apply_token_bitmask_(logits, token_bitmask)

    tokens = [0] * len(rows)
    for i, r in enumerate(rows):
        if r.forced_token is not None:
            tokens[i] = r.forced_token
    free = [r.forced_token is None for r in rows]
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy and free[i]]
    if greedy:
        picked = logits[greedy].argmax(dim=-1).tolist()
        for i, t in zip(greedy, picked):
            tokens[i] = int(t)
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy and free[i]]
    if random_rows:
        dev = logits.device
        ps = [rows[i].params for i in random_rows]
        vocab = logits.shape[-1]
        temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
        probs = torch.softmax(logits[random_rows] / temp.unsqueeze(1), dim=-1)
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in ps], device=dev)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)
        min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev)
        _filter_sorted_(sorted_probs, top_k, top_p, min_p)
        # argmax(p / q) with q ~ Exp(1) draws from p; one host read for all rows.
        noise = _exponential_noise(
            sorted_probs, [rows[i].generator or default_generator for i in random_rows]
        )
        choice = torch.argmax(sorted_probs / noise, dim=-1, keepdim=True)
        for i, t in zip(random_rows, sorted_idx.gather(1, choice).squeeze(1).tolist()):
            tokens[i] = int(t)

    logprobs: list[float | None] = [None] * len(rows)
    tops: list[list[tuple[int, float]] | None] = [None] * len(rows)
    if raw_lp is not None:
        want = [i for i, r in enumerate(rows) if r.return_logprob]
        chosen = raw_lp[want, [tokens[i] for i in want]].tolist()  # one host read
        for i, lp in zip(want, chosen):
            logprobs[i] = float(lp)
        for i in want:
            r = rows[i]
            if r.top_logprobs_num > 0:
                vals, idx = raw_lp[i].topk(min(r.top_logprobs_num, raw_lp.shape[-1]))
                tops[i] = list(zip(idx.tolist(), vals.tolist()))
    return SampleOutput(tokens, logprobs, tops)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
