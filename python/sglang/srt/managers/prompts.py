"""One place that reads a request's prompt fields: "text or input_ids", one prompt or a batch.

The offline engine, ``/generate``, ``/v1/completions`` and the tokenizer manager all take a prompt
as text or as token ids, never both; a list of either is a batch. Each entry point keeps its own
rule for an empty batch (the engine returns an empty list, the HTTP endpoints refuse it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.request_error import RequestError
from sglang.srt.sampling.sampling_params import SamplingParams, SamplingParamsError

# One prompt: exactly one of the two is set.
Prompt = tuple[str | None, list[int] | None]
PromptText = str | list[str] | None
PromptIds = list[int] | list[list[int]] | None


@dataclass(frozen=True)
class SplitPrompts:
    prompts: list[Prompt]
    batch: bool  # the caller sent a list of prompts (the answer is a list, even of one)


def check_one_kind(text: object, input_ids: object, text_name: str = "text") -> None:
    """Text or input_ids, exactly one. ``text_name`` is how the caller names the text field."""
    if text is not None and input_ids is not None:
        raise RequestError(f"give either {text_name} or input_ids, not both")
    if text is None and input_ids is None:
        raise RequestError("the request has no prompt: give text or input_ids")


def split_prompts(text: PromptText, input_ids: PromptIds, text_name: str = "text") -> SplitPrompts:
    """The prompts of a request, one entry each. The entries are not validated here (types,
    vocabulary, emptiness of one prompt): the tokenizer manager does that for every path."""
    check_one_kind(text, input_ids, text_name)
    if isinstance(text, list):
        return SplitPrompts([(t, None) for t in text], batch=True)
    if text is not None:
        return SplitPrompts([(text, None)], batch=False)
    assert input_ids is not None
    if input_ids and isinstance(input_ids[0], list):
        prompts: list[Prompt] = [(None, list(ids)) for ids in input_ids]  # type: ignore[arg-type]
        return SplitPrompts(prompts, batch=True)
    return SplitPrompts([(None, list(input_ids))], batch=False)  # type: ignore[arg-type]


def to_sampling_params(raw: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    """Sampling parameters from a request (a dict, or already parsed); bad ones are a 400."""
    if isinstance(raw, SamplingParams):
        return raw
    try:
        return SamplingParams.from_dict(raw)
    except SamplingParamsError as exc:
        raise RequestError(str(exc)) from None


def params_per_prompt(raw: Any, num_prompts: int) -> list[SamplingParams]:
    """One set of sampling parameters for every prompt, or a list with one per prompt."""
    raws = raw if isinstance(raw, list) else [raw] * num_prompts
    if len(raws) != num_prompts:
        raise RequestError(f"{len(raws)} sampling_params for {num_prompts} prompts")
    return [to_sampling_params(r) for r in raws]
