"""Repetition, frequency and presence penalties on one row of logits.

- repetition (multiplicative, as in CTRL / Hugging Face): every token seen in the prompt or the
  output so far has its logit divided by the penalty when positive, multiplied when negative;
- frequency / presence (additive, OpenAI semantics): over *output* tokens, subtract
  ``frequency_penalty * count + presence_penalty * (count > 0)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang.srt.sampling.sampling_params import SamplingParams


def apply_penalties_(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
) -> None:
    """Penalise ``logits [V]`` in place."""
    vocab = logits.shape[-1]
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = [t for t in {*prompt_ids, *output_ids} if 0 <= t < vocab]
        if seen:
            idx = torch.tensor(seen, dtype=torch.long, device=device)
            vals = logits[idx]
            p = params.repetition_penalty
            logits[idx] = torch.where(vals > 0, vals / p, vals * p)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and output_ids:
        ids = torch.tensor(
            [t for t in output_ids if 0 <= t < vocab], dtype=torch.long, device=device
        )
        counts = torch.bincount(ids, minlength=vocab).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
            logits.dtype
        )
