"""The default model's tokenizer: byte-level BPE built with the ``tokenizers`` library.

Byte-level means every string round-trips (unknown text falls back to single bytes). The merges
are learned from :data:`CORPUS` with a fixed vocabulary size, which is deterministic for a given
``tokenizers`` version; the result is cached on disk with the model, so one process tree always
sees one tokenizer. Special tokens come first, so their ids are fixed whatever the merges.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sglang.srt.default_model.corpus import CORPUS

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)
TARGET_VOCAB_SIZE = 1024

# A plain role-tagged chat format (Jinja, as Hugging Face tokenizers carry it):
#   <|begin_of_text|><|user|>hi<|end_of_text|><|assistant|>
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


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
    return tok


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json: what the serving layer reads next to tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
