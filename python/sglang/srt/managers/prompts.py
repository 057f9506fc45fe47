"""One place that turns a request's prompt fields into requests: "text or input_ids", one prompt
or a batch, one set of sampling parameters or one per prompt, ``n`` choices each.

The offline engine, ``/generate``, ``/v1/completions`` and ``/v1/chat/completions`` all call
:func:`build_requests`; the tokenizer manager validates each prompt. A list of prompts is a batch.
An empty batch is refused unless the caller allows it (the engine answers it with an empty list).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.generate_request import GenerateRequest, check_choices, expand_n
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


@dataclass(frozen=True)
class PromptRequests:
    """The requests of one call, grouped by prompt: ``groups[p]`` holds prompt ``p``'s ``n``
    choices (SGLang's order: each prompt's choices follow one another)."""

    groups: list[list[GenerateRequest]]
    batch: bool  # the caller sent a list of prompts (the answer is a list, even of one)

    @property
    def requests(self) -> list[GenerateRequest]:
        return [r for group in self.groups for r in group]


def build_requests(
    text: PromptText,
    input_ids: PromptIds,
    sampling_params: Any,
    template: GenerateRequest | None = None,
    *,
    text_name: str = "text",
    allow_empty: bool = False,
) -> PromptRequests:
    """Every request of a call: the prompts split, sampling parameters parsed (one set for all or
    one per prompt), at most :data:`MAX_CHOICES` prompts x n in all, each prompt expanded into its
    ``n`` choices. ``template`` carries the options every request shares (log-probs, stream,
    rid ...); its prompt and sampling fields are replaced. Raises :class:`RequestError`."""
    split = split_prompts(text, input_ids, text_name=text_name)
    if not split.prompts and not allow_empty:
        raise RequestError("the prompt list is empty")
    params = params_per_prompt(sampling_params, len(split.prompts))
    base = template or GenerateRequest()
    if len(split.prompts) > 1 and base.rid is not None:
        raise RequestError("rid names one request; leave it out for a batch")
    check_choices(len(split.prompts), max((p.n for p in params), default=1))
    groups = [
        expand_n(dataclasses.replace(base, text=t, input_ids=ids, sampling_params=p))
        for (t, ids), p in zip(split.prompts, params)
    ]
    return PromptRequests(groups, split.batch)
