"""Incremental detokenization (equals a full decode; no half characters while streaming), stop
strings (cut before the match, streaming holds back a possible start), chat templates."""

from __future__ import annotations

import itertools

from sglang.srt.default_model.tokenizer import BOS_TOKEN, build_tokenizer, tokenizer_config
from sglang.srt.managers.detokenizer import IncrementalDetokenizer
from sglang.srt.managers.tokenizer import FALLBACK_CHAT_TEMPLATE, TextTokenizer
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)

TEXT = "Hello wörld! 你好, the server is alive. def main():\n    return 0"


def _tok() -> TextTokenizer:
    return TextTokenizer(build_tokenizer(), tokenizer_config())


def test_incremental_equals_full_decode() -> None:
    tok = _tok()
    ids = tok.encode(TEXT, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    shown = []
    for i, t in enumerate(ids):
        d.add([t], final=i == len(ids) - 1)
        shown.append(d.visible_text(False))
        assert "\ufffd" not in shown[-1]
    assert d.text == tok.decode(ids) == TEXT
    assert all(b.startswith(a) for a, b in itertools.pairwise(shown))


def test_bos_and_special_tokens() -> None:
    tok = _tok()
    ids = tok.encode("hi")
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False).startswith(BOS_TOKEN)


def test_stop_string_cuts_and_holds_back() -> None:
    tok = _tok()
    ids = tok.encode("one two three four", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, stop=["three"])
    visible = []
    for t in ids:
        d.add([t])
        visible.append(d.visible_text(False))
        if d.matched_stop:
            break
    assert d.matched_stop == "three"
    assert d.text == "one two "
    assert all("thr" not in v for v in visible)
    d.add(tok.encode(" more", add_special_tokens=False))  # ignored after the stop
    assert d.text == "one two "


def test_chat_templates() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    plain = _tok()  # the default model has no template: its chats use DeepSeek V4's encoding
    assert plain.chat_template == FALLBACK_CHAT_TEMPLATE and not plain.has_own_chat_template
    assert (
        plain.apply_chat_template(msgs) == f"{BOS_TOKEN}system: be brief\n\nuser: hi\n\nassistant:"
    )
    cfg = {**tokenizer_config(), "chat_template": "{{ bos_token }}{{ messages[-1]['content'] }}"}
    own = TextTokenizer(build_tokenizer(), cfg)
    assert own.has_own_chat_template and own.apply_chat_template(msgs) == f"{BOS_TOKEN}hi"


if __name__ == "__main__":
    run_this_file(__file__)
