"""The workloads of ``python -m sglang.bench_serving``: what each request sends, generated from a
seed (standard library only, like the benchmark).

- ``random`` / ``fixed``: independent prompts of random token ids (lengths uniform in
  ``[len * ratio, len]``, or exactly ``len``), and as many random words for chat.
- ``generated-shared-prefix`` (SGLang's dataset of that name): ``--gsp-num-groups`` groups of
  ``--gsp-prompts-per-group`` prompts; the prompts of a group share one system prompt of
  ``--gsp-system-prompt-len`` tokens and end in their own question of ``--gsp-question-len``,
  shuffled across groups. A prompt's reusable tokens are its system prompt when an earlier
  prompt of its group exists.
- ``multi-turn``: ``--multi-turn-conversations`` chats of ``--multi-turn-turns`` turns over a
  system prompt each: turn ``k`` sends the system prompt, every earlier message and answer, and
  a new message of ``--multi-turn-message-len`` tokens; its reusable tokens are everything the
  previous turn sent and got back. Turns of one chat run in order, chats concurrently.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Filler words for prompts read as text (chat, and load scripts).
WORDS = (
    "the",
    "model",
    "serves",
    "tokens",
    "quickly",
    "and",
    "a",
    "river",
    "of",
    "light",
    "runs",
    "through",
    "old",
    "town",
    "where",
    "people",
    "sing",
)
DATASETS = ("random", "fixed", "generated-shared-prefix", "multi-turn")


@dataclass(frozen=True)
class Text:
    """One piece of a prompt as token ids (``/generate``, ``/v1/completions``) and as words of
    about the same length (chat)."""

    ids: list[int]
    words: str


@dataclass(frozen=True)
class BenchRequest:
    input_ids: list[int]
    text: str
    output_len: int
    reusable: int = 0  # prompt tokens an earlier request already sent (and got back)
    # chat: the messages, when the request is a turn of a conversation
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Conversation:
    system: Text
    messages: list[Text]
    output_len: int


def _lengths(rng: random.Random, n: int, target: int, ratio: float, fixed: bool) -> list[int]:
    if fixed:
        return [target] * n
    low = max(1, int(target * ratio))
    return [rng.randint(low, max(low, target)) for _ in range(n)]


def random_text(rng: random.Random, n: int, vocab_size: int) -> Text:
    low = min(16, vocab_size - 1)  # skip the first ids: special tokens usually live there
    ids = [rng.randrange(low, vocab_size) for _ in range(n)]
    return Text(ids, " ".join(rng.choice(WORDS) for _ in range(n)))


def random_requests(
    rng: random.Random,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    fixed: bool,
    vocab_size: int,
) -> list[BenchRequest]:
    ins = _lengths(rng, num_prompts, input_len, range_ratio, fixed)
    outs = _lengths(rng, num_prompts, output_len, range_ratio, fixed)
    reqs = []
    for n_in, n_out in zip(ins, outs):
        t = random_text(rng, n_in, vocab_size)
        reqs.append(BenchRequest(t.ids, t.words, n_out))
    return reqs


def shared_prefix_requests(
    rng: random.Random,
    *,
    num_groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    vocab_size: int,
) -> list[BenchRequest]:
    systems = [random_text(rng, system_len, vocab_size) for _ in range(num_groups)]
    order = [(g, i) for g in range(num_groups) for i in range(prompts_per_group)]
    rng.shuffle(order)
    seen: set[int] = set()
    reqs = []
    for g, _ in order:
        q = random_text(rng, question_len, vocab_size)
        system = systems[g]
        reusable = system_len if g in seen else 0
        seen.add(g)
        reqs.append(
            BenchRequest(system.ids + q.ids, f"{system.words}\n{q.words}", output_len, reusable)
        )
    return reqs


def conversations(
    rng: random.Random,
    *,
    num_conversations: int,
    turns: int,
    system_len: int,
    message_len: int,
    output_len: int,
    vocab_size: int,
) -> list[Conversation]:
    return [
        Conversation(
            random_text(rng, system_len, vocab_size),
            [random_text(rng, message_len, vocab_size) for _ in range(turns)],
            output_len,
        )
        for _ in range(num_conversations)
    ]


def conversation_turn(
    conv: Conversation, turn: int, answers: list[tuple[list[int], str]]
) -> BenchRequest:
    """Turn ``turn`` of ``conv`` given the ``answers`` (ids, text) of the turns before it."""
    ids = list(conv.system.ids)
    messages = [{"role": "system", "content": conv.system.words}]
    reusable = 0
    for k in range(turn):
        out_ids, out_text = answers[k]
        ids += conv.messages[k].ids + out_ids
        messages += [
            {"role": "user", "content": conv.messages[k].words},
            {"role": "assistant", "content": out_text},
        ]
    if turn:
        reusable = len(ids)  # the previous turn's prompt and answer
    ids += conv.messages[turn].ids
    messages.append({"role": "user", "content": conv.messages[turn].words})
    text = "\n".join(m["content"] for m in messages)
    return BenchRequest(ids, text, conv.output_len, reusable, messages)
