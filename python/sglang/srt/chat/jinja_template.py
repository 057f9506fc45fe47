"""A Jinja chat template as Hugging Face tokenizers carry it, rendered in a sandbox: the
tokenizer's own, a ``--chat-template`` file, or the plain fallback for tokenizers with none::

    <bos>system: ...\\n\\nuser: ...\\n\\nassistant: ...<eos>\\n\\nassistant:
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sglang.srt.chat.encoding import (
    ChatEncoding,
    ChatEncodingError,
    ChatOptions,
    ChatPrompt,
    PromptSegment,
)

FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + (message['content'] or '') }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\n\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


class JinjaTemplate:
    """A compiled template; ``render`` raises :class:`ChatEncodingError` for the template's own
    errors (its ``raise_exception`` included), which are the client's."""

    def __init__(self, source: str) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatEncodingError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._compiled = env.from_string(source)
        except TemplateError as exc:
            raise ValueError(f"the chat template does not parse: {exc}") from None

    def render(self, **variables: Any) -> str:
        try:
            return str(self._compiled.render(**variables))
        except ChatEncodingError:
            raise
        except Exception as exc:  # noqa: BLE001 - any template failure is the request's
            raise ChatEncodingError(f"cannot apply the chat template: {exc}") from None


class JinjaEncoding(ChatEncoding):
    name = "jinja"

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.template = JinjaTemplate(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions) -> ChatPrompt:
        thinking = self.thinking_enabled(options)
        text = self.template.render(
            **{k: v for k, v in options.template_kwargs.items() if isinstance(k, str)},
            messages=[dict(m) for m in messages],
            tools=[dict(t) for t in options.tools] or None,
            add_generation_prompt=not options.continue_final_message,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        return ChatPrompt((PromptSegment(text, special=True),), thinking)
