"""The tokenizer's vocabulary as xgrammar needs it: every id's bytes.

Byte-level BPE vocabularies (GPT-2 style, as DeepSeek and Kimi ship) store each token in a
printable byte alphabet; that is inverted here. Added tokens (the formats' markers) are their
own text, so a grammar literal such as ``<|open|>`` matches the marker's single token. Other
vocabularies (sentencepiece with byte fallback) go to xgrammar as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


@dataclass(frozen=True)
class VocabSource:
    """What xgrammar's ``TokenizerInfo`` is built from (plain data: picklable, cheap)."""

    entries: Sequence[str]  # id -> vocabulary entry
    added: Mapping[int, str]  # id -> text of added tokens
    byte_level: bool
    vocab_size: int  # the model's (logits') width, at least len(entries)
    stop_token_ids: Sequence[int]


def tokenizer_info(src: VocabSource) -> Any:
    import xgrammar as xgr

    stop = list(src.stop_token_ids) or None
    if not src.byte_level:
        vocab = [src.added.get(i, tok) for i, tok in enumerate(src.entries)]
        return xgr.TokenizerInfo(
            vocab, xgr.VocabType.BYTE_FALLBACK, vocab_size=src.vocab_size, stop_token_ids=stop
        )
    alphabet = byte_level_alphabet()
    raw: list[bytes] = []
    for i, tok in enumerate(src.entries):
        if i in src.added:
            raw.append(src.added[i].encode())
        elif all(c in alphabet for c in tok):
            raw.append(bytes(alphabet[c] for c in tok))
        else:  # not a byte-level entry: take its text
            raw.append(tok.encode())
    return xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=src.vocab_size, stop_token_ids=stop)
