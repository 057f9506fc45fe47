"""Structured output without a server: grammar checks and limits, the compile cache, the batched
bitmask in the sampler (constrained, unconstrained and forced rows in one step), the thinking
budget, and the tool-call grammars of both formats; JSON sampled from random logits under a
schema is valid and matches it."""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from sglang.srt.chat.deepseek_v4 import render_tool_calls
from sglang.srt.chat.encoding import ToolChoice
from sglang.srt.chat.messages import check_tools
from sglang.srt.constrained.grammar_compiler import GrammarCompiler
from sglang.srt.constrained.grammar_spec import (
    GrammarError,
    GrammarLimits,
    GrammarSpec,
    build_grammar,
)
from sglang.srt.constrained.request_grammar import RequestGrammar
from sglang.srt.default_model.tokenizer import build_tokenizer, tokenizer_config
from sglang.srt.managers.output_constraints import vocab_source
from sglang.srt.managers.tokenizer import TextTokenizer
from sglang.srt.parsers.registry import TOOL_CALL_FORMATS
from sglang.srt.sampling.sampler import SamplingRow, sample
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.sampling.thinking_budget import ReasoningControl, ReasoningTracker
from sglang.srt.sampling.token_bitmask import (
    BitmaskBuffer,
    apply_token_bitmask_,
    apply_token_bitmask_torch,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=6)

LIMITS = GrammarLimits(max_bytes=4096, max_depth=8, compile_timeout_s=30.0, max_whitespace=2)
EXTRA_VOCAB = 13  # logits wider than the tokenizer, as checkpoints pad their vocabulary
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


@cache
def _tok() -> TextTokenizer:
    return TextTokenizer(build_tokenizer(), tokenizer_config())


@cache
def _compiler() -> GrammarCompiler:
    tok = _tok()
    eos = tok.eos_token_id
    assert eos is not None
    src = vocab_source(tok, tok.vocab_size + EXTRA_VOCAB, [eos])
    return GrammarCompiler(lambda: src, LIMITS)


def _matches_person(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age", "pets"}
        and re.fullmatch("[a-z]{1,8}", value["name"]) is not None
        and isinstance(value["age"], int)
        and 0 <= value["age"] <= 120
        and len(value["pets"]) <= 3
        and all(p in ("cat", "dog") for p in value["pets"])
    )


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (GrammarSpec("json_schema", '{"type": "nope"}'), 'Unsupported type "nope"'),
        (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
        (GrammarSpec("json_schema", "[1, 2]"), "must be an object"),
        (GrammarSpec("json_schema", json.dumps({"enum": ["x" * 5000]})), "over the limit"),
        (
            GrammarSpec(
                "json_schema",
                json.dumps(
                    {
                        "$defs": {"node": {"properties": {"kid": {"$ref": "#/$defs/node"}}}},
                        "$ref": "#/$defs/node",
                    }
                ),
            ),
            "recursive",
        ),
        (GrammarSpec("json_schema", json.dumps({"items": {"items": {"items": {}}}})), None),
        (GrammarSpec("json_schema", '{"properties": {"a": {"$ref": "#"}}}'), "recursive"),
        (GrammarSpec("regex", "[a-"), "invalid regex"),
        (GrammarSpec("ebnf", "root ::= undefined_rule"), "invalid ebnf"),
    ],
)
def test_bad_grammars_are_named(spec: GrammarSpec, needle: str | None) -> None:
    if needle is None:
        build_grammar(spec, LIMITS)
        return
    with pytest.raises(GrammarError, match=re.escape(needle)):
        build_grammar(spec, LIMITS)


def test_depth_limit() -> None:
    nested: dict[str, Any] = {}
    node = nested
    for _ in range(10):
        node["properties"] = {"x": {}}
        node = node["properties"]["x"]
    with pytest.raises(GrammarError, match="deeper than 8"):
        build_grammar(GrammarSpec("json_schema", json.dumps(nested)), LIMITS)


def test_compile_cache_keys_on_the_spec() -> None:
    c = _compiler()
    a = GrammarSpec("json_schema", json.dumps(PERSON))
    assert c.submit(a) is c.submit(GrammarSpec("json_schema", json.dumps(PERSON)))
    assert c.submit(a) is not c.submit(GrammarSpec("json_schema", json.dumps(PERSON), "x"))
    bad = GrammarSpec("regex", "(")
    with pytest.raises(GrammarError):
        c.compile(bad)
    assert c.submit(bad) is c.submit(bad)  # the error is cached too


def _decode_under(spec: GrammarSpec, seed: int, steps: int = 400) -> str:
    """Sample from random logits through the sampler with the request's bitmask until the
    grammar accepts EOS."""
    tok = _tok()
    grammar = RequestGrammar(_compiler().compile(spec))
    vocab = tok.vocab_size + EXTRA_VOCAB
    buf = BitmaskBuffer(vocab)
    gen = torch.Generator().manual_seed(seed)
    row = SamplingRow(SamplingParams(temperature=1.0), [], [], generator=gen)
    out: list[int] = []
    for _ in range(steps):
        mask = buf.rows(1)
        grammar.fill_bitmask(mask, 0)
        logits = torch.randn(1, vocab, generator=gen) * 3
        token = sample(logits, [row], None, mask).token_ids[0]
        assert grammar.accept(token)
        if grammar.terminated:
            assert token == tok.eos_token_id
            return tok.decode(out)
        out.append(token)
    raise AssertionError(f"no end after {steps} tokens: {tok.decode(out)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_make_valid_json_under_a_schema(seed: int) -> None:
    text = _decode_under(GrammarSpec("json_schema", json.dumps(PERSON)), seed)
    assert _matches_person(json.loads(text)), text


def test_regex_and_wrapped_json() -> None:
    assert re.fullmatch(r"[a-c]{2}-\d", _decode_under(GrammarSpec("regex", r"[a-c]{2}-\d"), 0))
    spec = GrammarSpec("json_schema", json.dumps(PERSON), prefix="<open>", suffix="<close>")
    text = _decode_under(spec, 1)
    assert text.startswith("<open>") and text.endswith("<close>")
    assert _matches_person(json.loads(text[len("<open>") : -len("<close>")]))


def test_one_bitmask_for_a_mixed_batch() -> None:
    """Constrained, unconstrained and forced rows in one step: the bitmask is one tensor for
    the batch with all-ones rows where nothing is constrained; logits are masked in place."""
    tok = _tok()
    vocab = tok.vocab_size + EXTRA_VOCAB
    digits = RequestGrammar(_compiler().compile(GrammarSpec("regex", "[0-9]+")))
    buf = BitmaskBuffer(vocab)
    mask = buf.rows(3)
    digits.fill_bitmask(mask, 0)
    assert (mask[1:] == -1).all() and not (mask[0] == -1).all()
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5))
    raw = logits.clone()
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, [], []), SamplingRow(greedy, [], [])]
    rows.append(SamplingRow(greedy, [], [], forced_token=7, return_logprob=True))
    out = sample(logits, rows, None, mask)
    assert tok.decode([out.token_ids[0]]).isdigit()
    assert out.token_ids[1] == int(raw[1].argmax())
    assert out.token_ids[2] == 7
    assert out.logprobs[2] == pytest.approx(float(torch.log_softmax(raw[2], -1)[7]), abs=1e-5)
    assert torch.equal(logits[1], raw[1])  # the unconstrained row is untouched


def test_torch_fallback_matches_xgrammar() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 100, generator=g)
    mask = torch.randint(-(2**31), 2**31 - 1, (4, 4), generator=g, dtype=torch.int64).int()
    a, b = logits.clone(), logits.clone()
    apply_token_bitmask_(a, mask)
    apply_token_bitmask_torch(b, mask)
    assert torch.equal(a, b) and torch.isinf(a).any() and torch.isfinite(a).any()


def test_thinking_budget_forces_the_end_marker() -> None:
    end = (90, 91, 92)
    t = ReasoningTracker(ReasoningControl(end, budget=3))
    produced = []
    for model_token in [5, 90, 6, 8, 8, 8, 8]:
        forced = t.forced_token()
        token = model_token if forced is None else forced
        produced.append(token)
        ended = t.observe(token)
        if ended:
            break
    # 3 reasoning tokens (5, 90, 6), then the whole end sequence.
    assert produced == [5, 90, 6, 90, 91, 92] and not t.in_reasoning
    part = ReasoningTracker(ReasoningControl(end, budget=2))
    for token in (90, 91):  # the model has begun the end marker itself when the budget runs out
        assert part.forced_token() is None
        part.observe(token)
    assert part.forced_token() == 92
    free = ReasoningTracker(ReasoningControl(end))
    assert [free.observe(x) for x in (1, 90, 91, 92)] == [False, False, False, True]
    assert free.forced_token() is None


TOOLS = check_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 7},
                        "note": {"type": "string"},
                    },
                    "required": ["city", "days"],
                },
            },
        },
        {"type": "function", "function": {"name": "ping"}},
    ]
)


def _accepts(fmt: str, choice: ToolChoice, text: str, parallel: bool = True) -> bool:
    ebnf = TOOL_CALL_FORMATS.create(fmt).grammar(TOOLS, choice, parallel, False)
    spec = GrammarSpec("ebnf", ebnf, generated=True)  # over LIMITS.max_bytes, not the client's
    matcher = xgr.GrammarMatcher(_compiler().compile(spec))
    return matcher.accept_string(text) and matcher.is_completed()


def _call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "c",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def test_dsv4_tool_grammar_takes_the_format_and_the_schemas() -> None:
    required = ToolChoice("required")
    one = render_tool_calls([_call("get_weather", {"city": "Paris", "days": 3})])
    assert _accepts("deepseek-v4", required, one)
    both = render_tool_calls(
        [_call("get_weather", {"city": "Tokyo", "days": 1}), _call("ping", {})]
    )
    assert _accepts("deepseek-v4", required, both)
    assert not _accepts("deepseek-v4", required, both, parallel=False)
    assert not _accepts("deepseek-v4", ToolChoice("function", "ping"), one)
    for bad in ({"city": "Rome", "days": 3}, {"city": "Paris", "days": 9}, {"city": "Paris"}):
        assert not _accepts("deepseek-v4", required, render_tool_calls([_call("get_weather", bad)]))
    assert not _accepts("deepseek-v4", required, render_tool_calls([_call("nope", {})]))
    parser = TOOL_CALL_FORMATS.create("deepseek-v4").parser(TOOLS, required)
    parser.feed(one)
    parser.finish()
    assert json.loads(parser.calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_k3_tool_grammar_takes_the_format() -> None:
    call = (
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Tokyo<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>4<|close|>argument<|sep|>'
        "<|close|>call<|sep|>"
    )
    opening = "<|close|>response<|sep|><|open|>tools<|sep|>"
    closing = "<|close|>tools<|sep|><|close|>message<|sep|>"
    named = ToolChoice("function", "get_weather")
    assert _accepts("kimi-k3", named, opening + call + closing)
    assert not _accepts("kimi-k3", named, opening + call.replace("Tokyo", "Oslo") + closing)
    ping = '<|open|>call tool="ping" index="2"<|sep|><|close|>call<|sep|>'
    assert _accepts("kimi-k3", ToolChoice("required"), opening + call + ping + closing)


if __name__ == "__main__":
    run_this_file(__file__)
