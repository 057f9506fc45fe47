"""What structured output costs: the grammar's share of a decode step at batch 1 and 64 (mask
fill on the host, H2D copy and masking on the device, as microseconds and as % of the step), the
engine's TPOT with and without a JSON schema, schema compile time cold and cached, and the
latency the tool-call parsers add per streamed chunk.

The vocabulary is the built-in model's and a synthetic byte-level one as wide as DeepSeek V4's
(129,280 tokens), since the mask work grows with it. The engine part serves the built-in model,
or ``--model-path`` (e.g. the wide bench model that scripts/bench_serving_h200.py writes, with
``--tokenizer-path`` a directory holding a tokenizer.json). Runs on CPU (small numbers,
``--device cpu``); meaningful on the GPU.

Usage: PYTHONPATH=python python scripts/bench_grammar.py [--device cuda] [--batch 1,64]
       [--tokens 128] [--model-path DIR --tokenizer-path DIR] [--skip-engine]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from sglang.srt.chat.encoding import ToolChoice
from sglang.srt.chat.messages import check_tools
from sglang.srt.constrained.grammar_compiler import GrammarCompiler
from sglang.srt.constrained.grammar_spec import GrammarLimits, GrammarSpec
from sglang.srt.constrained.request_grammar import RequestGrammar, fill_bitmasks
from sglang.srt.constrained.tokenizer_vocab import VocabSource
from sglang.srt.default_model.tokenizer import build_tokenizer, tokenizer_config
from sglang.srt.managers.output_constraints import vocab_source
from sglang.srt.managers.tokenizer import TextTokenizer
from sglang.srt.parsers.chat_output import ChatOutputParser
from sglang.srt.parsers.reasoning import ReasoningParser
from sglang.srt.parsers.registry import REASONING_FORMATS, TOOL_CALL_FORMATS
from sglang.srt.sampling.sampler import SamplingRow, sample
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.sampling.token_bitmask import BitmaskBuffer

WIDE_VOCAB = 129280
# An array that cannot close within a benchmark: every step stays constrained.
ENDLESS = {
    "type": "array",
    "minItems": 100000,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
TOOLS = check_tools(
    [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string"},
                        "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                        "flags": {"type": "array", "items": {"type": "boolean"}},
                    },
                    "required": ["query"],
                },
            },
        }
        for i in range(8)
    ]
)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median microseconds of ``fn``."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def default_vocab() -> VocabSource:
    tok = TextTokenizer(build_tokenizer(), tokenizer_config())
    assert tok.eos_token_id is not None
    return vocab_source(tok, tok.vocab_size, [tok.eos_token_id])


def wide_vocab() -> VocabSource:
    """A byte-level-like vocabulary of DeepSeek V4's width: every byte, then fragments of
    letters, digits, spaces and JSON punctuation (fixed seed)."""
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-.,:;\"'{}[]\n"
    raw = [bytes([b]).decode("latin-1") for b in range(256)]
    seen = set(raw)
    while len(raw) < WIDE_VOCAB - 1:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        if piece not in seen:
            seen.add(piece)
            raw.append(piece)
    eos = len(raw)
    raw.append("</s>")
    return VocabSource(raw, {eos: "</s>"}, False, WIDE_VOCAB, [eos])


def compile_times(name: str, src: VocabSource) -> GrammarCompiler:
    limits = GrammarLimits(max_bytes=1 << 20, compile_timeout_s=600.0)
    compiler = GrammarCompiler(lambda: src, limits)
    t0 = time.perf_counter()
    compiler.warm_up()  # the vocabulary's one-time setup
    setup = (time.perf_counter() - t0) * 1e3
    for label, spec in (
        ("json_schema (person)", GrammarSpec("json_schema", json.dumps(PERSON))),
        ("json_schema (endless array)", GrammarSpec("json_schema", json.dumps(ENDLESS))),
        ("json_object", GrammarSpec("json_object")),
        ("tool calls, 8 tools (DSML)", _tool_spec("deepseek-v4")),
        ("tool calls, 8 tools (K3)", _tool_spec("kimi-k3")),
    ):
        t0 = time.perf_counter()
        compiler.compile(spec)
        cold = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        compiler.compile(spec)
        cached = (time.perf_counter() - t0) * 1e6
        print(f"compile {name:<8} {label:<30} cold {cold:9.1f} ms   cached {cached:7.1f} us")
    print(f"compile {name:<8} {'(vocabulary setup)':<30} {setup:14.1f} ms")
    return compiler


def _tool_spec(fmt: str) -> GrammarSpec:
    ebnf = TOOL_CALL_FORMATS.create(fmt).grammar(TOOLS, ToolChoice("required"), True, False)
    return GrammarSpec("ebnf", ebnf, generated=True)


def step_costs(name: str, compiler: GrammarCompiler, vocab: int, batch: int, device: str) -> None:
    """One decode step's grammar work for ``batch`` constrained rows, against sampling alone."""
    compiled = compiler.compile(GrammarSpec("json_schema", json.dumps(ENDLESS)))
    grammars = [RequestGrammar(compiled) for _ in range(batch)]
    buf = BitmaskBuffer(vocab)
    gen = torch.Generator().manual_seed(0)
    for g in grammars:  # move each matcher somewhere inside the array
        for _ in range(random.Random(id(g)).randint(3, 20)):
            mask = buf.rows(1)
            g.fill_bitmask(mask, 0)
            logits = torch.randn(1, vocab, generator=gen)
            row = SamplingRow(SamplingParams(temperature=1.0), [], [], generator=gen)
            g.accept(sample(logits, [row], None, mask).token_ids[0])
    logits = torch.randn(batch, vocab, device=device)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [], []) for _ in range(batch)]

    def fill() -> torch.Tensor:
        mask = buf.rows(batch)
        fill_bitmasks(grammars, mask, list(range(batch)))  # as the scheduler does
        return mask

    mask = fill()
    fill_us = _timed(fill, "cpu", 20)
    plain_us = _timed(lambda: sample(logits.clone(), rows, None), device, 20)
    masked_us = _timed(lambda: sample(logits.clone(), rows, None, mask), device, 20)
    print(
        f"step {name:<8} batch {batch:>3}: fill {fill_us:8.1f} us (host), sample {plain_us:8.1f}"
        f" us, sample + mask {masked_us:8.1f} us -> grammar {fill_us + masked_us - plain_us:8.1f}"
        " us per step"
    )


def engine_tpot(args: argparse.Namespace, batch: int) -> None:
    from sglang import Engine

    opts: dict[str, Any] = {"device": args.device, "random_seed": 0, "log_level": "warning"}
    if args.model_path:
        opts.update(model_path=args.model_path, tokenizer_path=args.tokenizer_path)
    schema = json.dumps(ENDLESS)
    prompts = [f"Request {i}: list people" for i in range(batch)]
    with Engine(**opts) as e:

        def run(tokens: int, grammar: bool) -> float:
            params: dict[str, Any] = {"max_new_tokens": tokens, "ignore_eos": True}
            params.update(temperature=0)
            if grammar:
                params["json_schema"] = schema
            t0 = time.perf_counter()
            out = e.generate(prompts, params)
            assert all(len(r["output_ids"]) == tokens for r in out), "a request ended early"
            return time.perf_counter() - t0

        tpot = {}
        for grammar in (False, True):
            run(args.tokens, grammar)  # warm-up: compiles, graph capture, the grammar
            one = min(run(1, grammar) for _ in range(2))
            full = min(run(args.tokens, grammar) for _ in range(2))
            tpot[grammar] = (full - one) / (args.tokens - 1) * 1e3
    extra = tpot[True] - tpot[False]
    print(
        f"engine batch {batch:>3}: TPOT {tpot[False]:8.3f} ms plain, {tpot[True]:8.3f} ms with a "
        f"JSON schema -> grammar {extra:7.3f} ms per step ({100 * extra / tpot[False]:5.1f}% of "
        "TPOT)"
    )


def stream_latency() -> None:
    tools = check_tools([{"type": "function", "function": {"name": "get_weather"}}])
    dsml = (
        "Let me check the weather first.</think>Sure.\n\n<｜DSML｜tool_calls>\n"
        + "".join(
            f'<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
            f'City {i}</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">{i}'
            "</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
            for i in range(8)
        )
        + "</｜DSML｜tool_calls>"
    )
    xtml = (
        "Let me check.<|close|>think<|sep|><|open|>response<|sep|>Sure.<|close|>response<|sep|>"
        "<|open|>tools<|sep|>"
        + "".join(
            f'<|open|>call tool="get_weather" index="{i + 1}"<|sep|><|open|>argument key="city" '
            f'type="string"<|sep|>City {i}<|close|>argument<|sep|><|close|>call<|sep|>'
            for i in range(8)
        )
        + "<|close|>tools<|sep|><|close|>message<|sep|>"
    )
    for fmt, text in (("deepseek-v4", dsml), ("kimi-k3", xtml)):
        chunks = [text[i : i + 3] for i in range(0, len(text), 3)]  # about a token each

        def parse(fmt: str = fmt, chunks: list[str] = chunks) -> None:
            reasoning = ReasoningParser(REASONING_FORMATS[fmt], in_reasoning=True)
            p = ChatOutputParser(reasoning, TOOL_CALL_FORMATS.create(fmt).parser(tools))
            for c in chunks:
                p.feed(c)
            p.finish()

        us = _timed(parse, "cpu", 20) / len(chunks)
        print(f"stream {fmt:<12} {len(chunks)} chunks: {us:6.2f} us added per chunk")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", default=None, help="default: 1,64 on cuda, 1,8 on cpu")
    ap.add_argument("--tokens", type=int, default=None, help="default: 128 on cuda, 24 on cpu")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    on_gpu = args.device == "cuda"
    batches = [int(b) for b in (args.batch or ("1,64" if on_gpu else "1,8")).split(",")]
    args.tokens = args.tokens or (128 if on_gpu else 24)
    print(f"device {args.device}; batches {batches}")
    small = default_vocab()
    compilers = {
        "builtin": compile_times("builtin", small),
        "wide": compile_times("wide", wide_vocab()),
    }
    widths = {"builtin": small.vocab_size, "wide": WIDE_VOCAB}
    for name, compiler in compilers.items():
        for b in batches:
            step_costs(name, compiler, widths[name], b, args.device)
    stream_latency()
    if not args.skip_engine:
        for b in batches:
            engine_tpot(args, b)


if __name__ == "__main__":
    main()
