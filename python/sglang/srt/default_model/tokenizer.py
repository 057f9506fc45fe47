"""The default model's tokenizer: byte-level BPE built with the ``tokenizers`` library.

Byte-level means every string round-trips (unknown text falls back to single bytes). The merges
are learned from :data:`CORPUS` with a fixed vocabulary size, which is deterministic for a given
``tokenizers`` version; the result is cached on disk with the model, so one process tree always
sees one tokenizer. Special tokens come first, so their ids are fixed whatever the merges; the
reasoning and tool-call markers are appended after the merges.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from sglang.srt.default_model.corpus import CORPUS

# DeepSeek V4's markers (the model has DeepSeek V4's architecture and chat encoding): the turn
# markers are special tokens (dropped from decoded text); the reasoning and tool-call markers are
# plain added tokens, so they stay in the text for the reasoning and tool-call parsers.
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    LATEST_REMINDER_TOKEN,
)
MARKER_TOKENS: tuple[str, ...] = ("<think>", "</think>", "｜DSML｜")
TARGET_VOCAB_SIZE = 1024


def special_token_id(token: str) -> int:
    return SPECIAL_TOKENS.index(token)


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    return tok


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json: what the serving layer reads next to tokenizer.json. No Jinja chat
    template: chats use DeepSeek V4's encoding, chosen by the model type."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "model_max_length": 4096,
    }
