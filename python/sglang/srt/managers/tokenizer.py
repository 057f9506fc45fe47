"""Text <-> token ids for the serving layer.

Loads ``tokenizer.json`` with the ``tokenizers`` library (no transformers needed) plus
``tokenizer_config.json`` for the BOS/EOS tokens, whether to prepend BOS, and the Jinja chat
template if the tokenizer ships one (rendered by :mod:`sglang.srt.chat.jinja_template`; a
tokenizer without one gets :data:`FALLBACK_CHAT_TEMPLATE`). Chat prompts come as segments: those
that may hold control tokens are encoded with special tokens recognized, client text with them
read as plain text (:meth:`TextTokenizer.encode_segments`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from sglang.srt.chat.encoding import PromptSegment
from sglang.srt.chat.jinja_template import FALLBACK_CHAT_TEMPLATE, JinjaTemplate

__all__ = ["FALLBACK_CHAT_TEMPLATE", "TextTokenizer", "TokenizerLoadError", "load_tokenizer"]


class TokenizerLoadError(RuntimeError):
    pass


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, Any]) -> None:
        self._tok = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        self.add_bos_token = bool(config.get("add_bos_token", False))
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        self.has_own_chat_template = isinstance(template, str) and bool(template)
        self.chat_template: str = template if self.has_own_chat_template else FALLBACK_CHAT_TEMPLATE  # type: ignore[assignment]
        self._compiled: JinjaTemplate | None = None
        self._longest: int | None = None
        self._plain: Tokenizer | None = None  # a copy that reads special tokens as text

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def longest_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (bounds the text one token can cover)."""
        if self._longest is None:
            self._longest = max((len(t) for t in self._tok.get_vocab()), default=1)
        return self._longest

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not), so a large prompt
        # tokenized in a worker thread does not stall the event loop.
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token_text(self, token_id: int) -> str:
        """What one token reads as on its own (for log-prob listings)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """This tokenizer's Jinja template (or the fallback) applied to plain messages."""
        if self._compiled is None:
            self._compiled = JinjaTemplate(self.chat_template)
        return self._compiled.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    # --- special tokens and chat segments ------------------------------------------------------

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` when it is one vocabulary entry (an added token or a plain one)."""
        return self._tok.token_to_id(token)

    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens flagged special (what ``skip_special_tokens`` drops)."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def encode_segments(self, segments: Sequence[PromptSegment]) -> list[int]:
        """A chat prompt's ids, one segment at a time: a segment marked ``special`` may contain
        control tokens; in the others special-token spellings stay text."""
        ids: list[int] = []
        for seg in segments:
            if seg.special:
                ids += self.encode(seg.text, add_special_tokens=False)
                continue
            if self._plain is None:
                plain = Tokenizer.from_str(self._tok.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
            ids += self._plain.encode_batch([seg.text], add_special_tokens=False)[0].ids
        return ids

    def vocab(self) -> list[str]:
        """Every id's vocabulary entry, as the tokenizer's model stores it (byte-level tokens in
        their byte alphabet; added tokens as their text)."""
        entries = [""] * self._tok.get_vocab_size(with_added_tokens=True)
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if 0 <= i < len(entries):
                entries[i] = token
        return entries

    def added_token_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    @property
    def decoder_kind(self) -> str:
        """``ByteLevel``, ``Metaspace``, ``Sequence`` ... (how ids map back to text)."""
        decoder = self._tok.decoder
        return "" if decoder is None else type(decoder).__name__


def load_tokenizer(path: str) -> TextTokenizer:
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise TokenizerLoadError(
            f"no tokenizer.json in {path!r}; give --tokenizer-path a directory that has one, or "
            "start with --skip-tokenizer-init and send token ids"
        )
    config: dict[str, Any] = {}
    config_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    return TextTokenizer(Tokenizer.from_file(file), config)
