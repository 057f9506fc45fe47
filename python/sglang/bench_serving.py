"""``python -m sglang.bench_serving``: load a running server with random prompts and report
latency and throughput, with SGLang's metric definitions.

- TTFT: request start to the first streamed chunk that carries output.
- ITL: gaps between consecutive output chunks of a request.
- TPOT: ``(E2E - TTFT) / (output tokens - 1)`` per request (requests with one token skipped).
- E2E: request start to its last byte.
- Throughput: completed requests, input, output and total tokens per second of wall time;
  concurrency = summed request time / wall time.

Backends: ``sglang`` (``/generate`` with token ids: exact input lengths), ``sglang-oai``
(``/v1/completions`` with token-id prompts) and ``sglang-oai-chat`` (``/v1/chat/completions``
with random words; input lengths approximate). Datasets (``sglang.bench_workloads``):
``random`` (lengths uniform in ``[len * range_ratio, len]``), ``fixed`` (exactly the given
lengths), ``generated-shared-prefix`` (groups of prompts sharing a system prompt) and
``multi-turn`` (chats resending their whole history each turn; ``sglang`` sends the exact ids
the server returned, ``sglang-oai-chat`` the messages). Arrivals are Poisson at
``--request-rate`` (``inf``: all at once; a chat's turns follow each other), at most
``--max-concurrency`` in flight.

Prefix cache: every response says how many prompt tokens the server resumed from its cache
(``meta_info.cached_tokens``, ``usage.prompt_tokens_details.cached_tokens``); the report gives
the cached share of all input tokens and of the reusable ones (tokens an earlier request of the
run sent before: a shared system prompt, a chat's history).
Only the standard library is used, so it runs wherever the server's clients run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sglang.bench_workloads import (
    DATASETS,
    BenchRequest,
    Conversation,
    conversation_turn,
    conversations,
    random_requests,
    shared_prefix_requests,
)

BACKENDS = ("sglang", "sglang-oai", "sglang-oai-chat")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    input_len: int = 0
    output_len: int = 0
    cached_len: int = 0  # prompt tokens the server took from its prefix cache
    reusable: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)  # the sglang backend's
    text: str = ""


# --- workload -----------------------------------------------------------------------------------


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    """The independent requests of the dataset (``multi-turn`` is made turn by turn)."""
    rng = random.Random(args.seed)
    if args.dataset_name == "generated-shared-prefix":
        return shared_prefix_requests(
            rng,
            num_groups=args.gsp_num_groups,
            prompts_per_group=args.gsp_prompts_per_group,
            system_len=args.gsp_system_prompt_len,
            question_len=args.gsp_question_len,
            output_len=args.gsp_output_len,
            vocab_size=vocab_size,
        )
    return random_requests(
        rng,
        num_prompts=args.num_prompts,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        fixed=args.dataset_name == "fixed",
        vocab_size=vocab_size,
    )


def make_conversations(args: argparse.Namespace, vocab_size: int) -> list[Conversation]:
    return conversations(
        random.Random(args.seed),
        num_conversations=args.multi_turn_conversations,
        turns=args.multi_turn_turns,
        system_len=args.multi_turn_system_len,
        message_len=args.multi_turn_message_len,
        output_len=args.multi_turn_output_len,
        vocab_size=vocab_size,
    )


# --- one request --------------------------------------------------------------------------------


def _payload(backend: str, req: BenchRequest, model: str) -> tuple[str, dict[str, Any]]:
    if backend == "sglang":
        return "/generate", {
            "input_ids": req.input_ids,
            "sampling_params": {
                "max_new_tokens": req.output_len,
                "ignore_eos": True,
                "temperature": 0.0,
            },
            "stream": True,
        }
    common = {
        "model": model,
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if backend == "sglang-oai":
        return "/v1/completions", {"prompt": req.input_ids, **common}
    messages = req.messages or [{"role": "user", "content": req.text}]
    return "/v1/chat/completions", {"messages": messages, **common}


@dataclass(frozen=True)
class Chunk:
    """What one streamed chunk says: new output tokens, and the prompt and cached token counts
    when it reports them."""

    new: int
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""


def _parse_chunk(backend: str, data: dict[str, Any], seen: int) -> Chunk:
    if backend == "sglang":
        meta = data.get("meta_info", {})
        n = len(data.get("output_ids", []))
        return Chunk(n - seen, meta.get("prompt_tokens"), meta.get("cached_tokens"))
    usage = data.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return Chunk(usage["completion_tokens"] - seen, usage["prompt_tokens"], cached)
    choices = data.get("choices") or []
    if not choices:
        return Chunk(0)
    c = choices[0]
    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
    return Chunk(1 if piece else 0, text=piece or "")


def run_one(
    base_url: str, backend: str, req: BenchRequest, model: str, timeout_s: float
) -> RequestResult:
    path, body = _payload(backend, req, model)
    result = RequestResult(input_len=len(req.input_ids), reusable=req.reusable)
    http = urllib.request.Request(
        base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    last = start
    tokens = 0
    try:
        with urllib.request.urlopen(http, timeout=timeout_s) as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    raise RuntimeError(data["error"].get("message", "error"))
                chunk = _parse_chunk(backend, data, tokens)
                new = chunk.new
                if chunk.prompt_tokens is not None:
                    result.input_len = chunk.prompt_tokens
                if chunk.cached_tokens is not None:
                    result.cached_len = chunk.cached_tokens
                if backend == "sglang":
                    result.output_ids = list(data.get("output_ids", result.output_ids))
                result.text += chunk.text
                if backend != "sglang" and data.get("usage"):
                    tokens += new  # usage only corrects the count; it is not an output chunk
                    continue
                if new <= 0:
                    continue
                now = time.perf_counter()
                if tokens == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                tokens += new
        result.e2e = time.perf_counter() - start
        result.output_len = tokens
        result.ok = tokens > 0
        if not result.ok:
            result.error = "no output tokens"
    except (urllib.error.URLError, OSError, RuntimeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# --- the run ------------------------------------------------------------------------------------


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return data


def percentile(values: Sequence[float], q: float, empty: float = 0.0) -> float:
    """The nearest-rank ``q``-th percentile (``q`` in 0..100) of ``values``; ``empty`` for none."""
    if not values:
        return empty
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def _summary(values: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "mean": statistics.fmean(ms) if ms else 0.0,
        "median": statistics.median(ms) if ms else 0.0,
        "p95": percentile(ms, 95),
        "p99": percentile(ms, 99),
        "max": max(ms) if ms else 0.0,
    }


def compute_metrics(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    inp = sum(r.input_len for r in ok)
    out = sum(r.output_len for r in ok)
    cached = sum(r.cached_len for r in ok)
    reusable = sum(r.reusable for r in ok)
    return {
        "total_cached_tokens": cached,
        "total_reusable_tokens": reusable,
        # the cached share of all input tokens, and of the tokens earlier requests sent before
        "cache_hit_rate": cached / inp if inp else 0.0,
        "reusable_hit_rate": cached / reusable if reusable else 0.0,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "input_throughput": inp / duration_s if duration_s else 0.0,
        "output_throughput": out / duration_s if duration_s else 0.0,
        "total_throughput": (inp + out) / duration_s if duration_s else 0.0,
        "concurrency": sum(r.e2e for r in ok) / duration_s if duration_s else 0.0,
        "ttft_ms": _summary([r.ttft for r in ok]),
        "tpot_ms": _summary(tpot),
        "itl_ms": _summary([g for r in ok for g in r.itl]),
        "e2e_ms": _summary([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def print_table(args: argparse.Namespace, m: dict[str, Any]) -> None:
    w = 44
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    rows: list[tuple[str, Any]] = [
        ("Backend", args.backend),
        ("Dataset", _dataset_line(args)),
        ("Request rate (req/s)", args.request_rate),
        ("Max concurrency", args.max_concurrency or "unlimited"),
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{m['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{m['total_throughput']:.2f}"),
        ("Concurrency", f"{m['concurrency']:.2f}"),
        ("Cached input tokens", m["total_cached_tokens"]),
        ("Cache hit rate (of input tokens)", f"{m['cache_hit_rate']:.2%}"),
        ("Reusable input tokens", m["total_reusable_tokens"]),
        ("Cache hit rate (of reusable tokens)", f"{m['reusable_hit_rate']:.2%}"),
    ]
    for label, value in rows:
        print(f"{label + ':':<{w}}{value}")
    for key, title in (
        ("e2e_ms", "End-to-End Latency"),
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "Inter-Token Latency"),
    ):
        print(f"{'-' * 15}{title:^36}{'-' * 15}")
        for stat in ("mean", "median", "p95", "p99", "max"):
            print(f"{f'{stat.capitalize()} (ms):':<{w}}{m[key][stat]:.2f}")
    if m["errors"]:
        print(f"errors: {m['errors']}")
    print("=" * 66)


def _dataset_line(args: argparse.Namespace) -> str:
    if args.dataset_name == "generated-shared-prefix":
        return (
            f"generated-shared-prefix ({args.gsp_num_groups} groups x "
            f"{args.gsp_prompts_per_group} prompts, system {args.gsp_system_prompt_len}, "
            f"question {args.gsp_question_len}, out {args.gsp_output_len})"
        )
    if args.dataset_name == "multi-turn":
        return (
            f"multi-turn ({args.multi_turn_conversations} chats x {args.multi_turn_turns} turns, "
            f"system {args.multi_turn_system_len}, message {args.multi_turn_message_len}, "
            f"out {args.multi_turn_output_len})"
        )
    return f"{args.dataset_name} (in {args.random_input_len}, out {args.random_output_len})"


def _run_chats(
    args: argparse.Namespace, base: str, model: str, chats: list[Conversation]
) -> list[RequestResult]:
    """Every chat's turns in order (the next one sends the answers the server gave), chats
    concurrently (their starts Poisson at ``--request-rate``)."""
    if args.backend == "sglang-oai":
        raise SystemExit(
            "--dataset-name multi-turn resends the server's answers: use --backend sglang (token "
            "ids) or sglang-oai-chat (messages); /v1/completions returns text, not ids"
        )
    results: list[list[RequestResult]] = [[] for _ in chats]

    def chat(i: int) -> None:
        answers: list[tuple[list[int], str]] = []
        for turn in range(len(chats[i].messages)):
            req = conversation_turn(chats[i], turn, answers)
            r = run_one(base, args.backend, req, model, args.timeout)
            results[i].append(r)
            if not r.ok:
                return
            answers.append((r.output_ids, r.text))

    _send_all(args, len(chats), chat)
    return [r for rs in results for r in rs]


def _send_all(args: argparse.Namespace, count: int, send: Callable[[int], None]) -> None:
    """``send(i)`` for each of ``count`` items on ``--max-concurrency`` threads (default: all at
    once), their starts Poisson at ``--request-rate`` (inf: no gaps); returns when all are done and
    re-raises the first failure."""
    rng = random.Random(args.seed + 1)
    workers = args.max_concurrency or count or 1
    futures: list[Future[None]] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i in range(count):
            futures.append(pool.submit(send, i))
            if args.request_rate != float("inf") and i + 1 < count:
                time.sleep(rng.expovariate(args.request_rate))
        for f in futures:
            f.result()


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    base = args.base_url or f"http://{args.host}:{args.port}"
    info = _get_json(base + "/get_model_info")
    model = args.model or info.get("served_model_name") or "default"
    vocab = int(info.get("vocab_size") or 32000)
    if args.dataset_name == "multi-turn":
        start = time.perf_counter()
        results = _run_chats(args, base, model, make_conversations(args, vocab))
        return _finish(args, results, time.perf_counter() - start)
    reqs = make_requests(args, vocab)
    # Warm-up: full-length prompts, a few output tokens, sent as concurrently as the run will be,
    # so the prefill shapes the run hits are compiled before anything is timed.
    warm = [BenchRequest(r.input_ids, r.text, 4) for r in reqs[: args.warmup_requests]]
    if warm:
        with ThreadPoolExecutor(
            max_workers=min(len(warm), args.max_concurrency or len(warm))
        ) as pool:
            list(pool.map(lambda r: run_one(base, args.backend, r, model, args.timeout), warm))
    results: list[RequestResult] = [RequestResult() for _ in reqs]
    lock = threading.Lock()

    def task(i: int) -> None:
        r = run_one(base, args.backend, reqs[i], model, args.timeout)
        with lock:
            results[i] = r

    start = time.perf_counter()
    _send_all(args, len(reqs), task)
    return _finish(args, results, time.perf_counter() - start)


def _finish(
    args: argparse.Namespace, results: list[RequestResult], duration: float
) -> dict[str, Any]:
    metrics = compute_metrics(results, duration)
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps({"args": vars(args), **metrics}) + "\n")
    return metrics


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang.bench_serving", description=__doc__.split("\n")[0]
    )
    p.add_argument("--backend", choices=BACKENDS, default="sglang")
    p.add_argument("--base-url", type=str, default=None, help="Overrides --host/--port.")
    p.add_argument("--host", type=str, default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", type=str, default=None, help="Default: the server's model name.")
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.5,
        help="random dataset: lengths uniform in [len * ratio, len].",
    )
    g = p.add_argument_group("generated-shared-prefix (SGLang's flags)")
    g.add_argument("--gsp-num-groups", type=int, default=64, help="System prompts.")
    g.add_argument("--gsp-prompts-per-group", type=int, default=16, help="Prompts sharing each.")
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    g.add_argument("--gsp-question-len", type=int, default=128)
    g.add_argument("--gsp-output-len", type=int, default=256)
    g = p.add_argument_group("multi-turn")
    g.add_argument("--multi-turn-conversations", type=int, default=32)
    g.add_argument("--multi-turn-turns", type=int, default=8)
    g.add_argument("--multi-turn-system-len", type=int, default=1024)
    g.add_argument("--multi-turn-message-len", type=int, default=256)
    g.add_argument("--multi-turn-output-len", type=int, default=128)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrival rate in requests/s; inf sends all at once.",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="Requests in flight at most.")
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="Untimed full-length requests (4 output tokens) sent first, as concurrently "
        "as --max-concurrency allows.",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="Seconds per request.")
    p.add_argument("--output-file", type=str, default=None, help="Append results as JSONL.")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    metrics = run_benchmark(args)
    print_table(args, metrics)
    return 0 if metrics["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
