"""Chat encodings by name (``--chat-template NAME``) and by the checkpoint's model type."""

from __future__ import annotations

import os

from sglang.srt.chat.encoding import ChatEncoding
from sglang.srt.utils.registry import Registry

CHAT_ENCODINGS: Registry[ChatEncoding] = Registry("chat encoding")

# config.json model_type -> the built-in encoding of that format.
ENCODING_BY_MODEL_TYPE: dict[str, str] = {"deepseek_v4": "deepseek-v4", "kimi_k3": "kimi-k3"}


@CHAT_ENCODINGS.register("deepseek-v4")
def _deepseek_v4() -> ChatEncoding:
    from sglang.srt.chat.deepseek_v4 import DeepseekV4Encoding

    return DeepseekV4Encoding()


@CHAT_ENCODINGS.register("kimi-k3")
def _kimi_k3() -> ChatEncoding:
    from sglang.srt.chat.kimi_k3 import KimiK3Encoding

    return KimiK3Encoding()


def chat_template_error(chat_template: str) -> str | None:
    """Why ``--chat-template`` cannot be used (None: it can): a built-in name or a file."""
    if chat_template in CHAT_ENCODINGS.names() or os.path.isfile(chat_template):
        return None
    return (
        f"--chat-template {chat_template!r} is neither a built-in encoding "
        f"({', '.join(CHAT_ENCODINGS.names())}) nor a Jinja template file"
    )


def resolve_chat_encoding(
    chat_template: str | None,
    model_type: str | None,
    tokenizer_template: str | None,
    bos_token: str = "",
    eos_token: str = "",
) -> ChatEncoding:
    """``--chat-template`` (a built-in name or a Jinja file) first, then the built-in encoding of
    the model type, then the tokenizer's own Jinja template, then the plain fallback."""
    from sglang.srt.chat.jinja_template import FALLBACK_CHAT_TEMPLATE, JinjaEncoding

    if chat_template is not None:
        if chat_template in CHAT_ENCODINGS.names():
            return CHAT_ENCODINGS.create(chat_template)
        with open(chat_template, encoding="utf-8") as f:
            return JinjaEncoding(f.read(), bos_token, eos_token)
    if model_type in ENCODING_BY_MODEL_TYPE:
        return CHAT_ENCODINGS.create(ENCODING_BY_MODEL_TYPE[model_type])
    return JinjaEncoding(tokenizer_template or FALLBACK_CHAT_TEMPLATE, bos_token, eos_token)
