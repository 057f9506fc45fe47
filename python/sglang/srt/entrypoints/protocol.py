"""Request bodies of the HTTP API (pydantic): SGLang's native ``/generate`` and OpenAI's
completions and chat completions.

Strict, as a careful client expects: a field of the wrong type is a 400 naming it (no coercion of
``"yes"`` to true or ``"10"`` to 10); an OpenAI parameter this server does not implement
(``suffix``, the deprecated ``functions`` ...) and a field no API defines are 400s naming them
(:meth:`unsupported`), instead of being silently ignored. Tools, tool choice and response formats
are checked further where they are used (``sglang.srt.chat.messages``). Range checks on sampling
values happen once, in :class:`SamplingParams`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr


def _number(v: Any) -> Any:
    # pydantic's float takes "1.5" and true; a JSON number is what the API means.
    if isinstance(v, (str, bool)):
        raise ValueError("must be a number")  # noqa: TRY004 - pydantic reports ValueError only
    return v


Number = Annotated[float, BeforeValidator(_number)]
# Kept as ints (a 2**70 seed must reach the range check, not become a float).
Int = StrictInt
Bool = StrictBool
Str = StrictStr


class _Body(BaseModel):
    # Extra fields are kept so that unsupported() can name them.
    model_config = ConfigDict(extra="allow")

    # field -> values accepted as "not used" (the field is defined by OpenAI, not implemented)
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def unsupported(self) -> list[str]:
        """The parameters this server would have to ignore, each with why."""
        problems = [
            f"{name} (not supported by this server)"
            for name, noop in self.UNSUPPORTED.items()
            if getattr(self, name, None) not in (None, *noop)
        ]
        extra = sorted(self.model_extra or {})
        if extra:
            problems.append(f"unknown parameter(s) {extra}")
        return problems


# --- native -------------------------------------------------------------------------------------


class GenerateReqInput(_Body):
    text: Str | list[Str] | None = None
    input_ids: list[Int] | list[list[Int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: Bool = False
    return_logprob: Bool = False
    top_logprobs_num: Int = 0
    logprob_start_len: Int = -1
    rid: Str | None = None
    # SGLang: return the reasoning apart ("reasoning_text") from the answer ("text"); the
    # output is read as starting inside the reasoning.
    separate_reasoning: Bool = False


class AbortReqInput(_Body):
    rid: Str


# --- OpenAI ---------------------------------------------------------------------------------------


class StreamOptions(_Body):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class _SamplingFields(_Body):
    """Sampling fields shared by completions and chat (OpenAI names plus SGLang extensions)."""

    model: Str | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: Int = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: Str | list[Str] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    seed: Int | None = None
    logit_bias: dict[str, Number] | None = None
    user: Str | None = None
    # extensions (SGLang / vLLM)
    top_k: Int | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: Bool = False
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: Bool = True


class CompletionRequest(_SamplingFields):
    prompt: Str | list[Str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: Bool = False
    # OpenAI parameters without an implementation here
    best_of: Any = None
    suffix: Any = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {"suffix": ("",)}

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        if self.best_of is not None and self.best_of != self.n:
            problems.insert(0, "best_of (not supported by this server unless equal to n)")
        return problems


class TextContentPart(_Body):
    type: Literal["text"]
    text: Str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[TextContentPart] | None = None
    name: Str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant turns
    tool_call_id: Str | None = None  # tool results
    reasoning_content: Str | None = None  # an earlier assistant turn's reasoning, passed back
    reasoning: Str | None = None  # the same, as some clients spell it


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: Str | None = None
    # extensions (SGLang / vLLM)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"thinking": true}
    separate_reasoning: Bool = True  # false: the reasoning stays in the content
    thinking_budget: Int | None = None  # reasoning tokens before the reasoning is ended
    continue_final_message: Bool = False
    # OpenAI parameters without an implementation here
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "functions": ([],),
        "function_call": ("none",),
        "audio": (),
        "modalities": (["text"],),
        "prediction": (),
        "store": (False,),
        "service_tier": ("auto", "default"),
    }
