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
with random words; input lengths approximate). Datasets: ``random`` (lengths uniform in
``[len * range_ratio, len]``) and ``fixed`` (exactly the given lengths). Arrivals are Poisson at
``--request-rate`` (``inf``: all at once), at most ``--max-concurrency`` in flight.
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
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("sglang", "sglang-oai", "sglang-oai-chat")
_WORDS = (
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


@dataclass(frozen=True)
class BenchRequest:
    input_ids: list[int]
    text: str
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    input_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


# --- workload -----------------------------------------------------------------------------------


def _lengths(rng: random.Random, n: int, target: int, ratio: float, fixed: bool) -> list[int]:
    if fixed:
        return [target] * n
    low = max(1, int(target * ratio))
    return [rng.randint(low, max(low, target)) for _ in range(n)]


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    fixed = args.dataset_name == "fixed"
    ins = _lengths(rng, args.num_prompts, args.random_input_len, args.random_range_ratio, fixed)
    outs = _lengths(rng, args.num_prompts, args.random_output_len, args.random_range_ratio, fixed)
    low = min(16, vocab_size - 1)  # skip the first ids: special tokens usually live there
    reqs = []
    for n_in, n_out in zip(ins, outs):
        ids = [rng.randrange(low, vocab_size) for _ in range(n_in)]
        text = " ".join(rng.choice(_WORDS) for _ in range(n_in))
        reqs.append(BenchRequest(ids, text, n_out))
    return reqs


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
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": req.text}], **common}


def _chunk_tokens(backend: str, data: dict[str, Any], seen: int) -> tuple[int, int | None]:
    """(new output tokens in this chunk, reported prompt tokens or None)."""
    if backend == "sglang":
        n = len(data.get("output_ids", []))
        return n - seen, data.get("meta_info", {}).get("prompt_tokens")
    usage = data.get("usage")
    if usage:
        return usage["completion_tokens"] - seen, usage["prompt_tokens"]
    choices = data.get("choices") or []
    if not choices:
        return 0, None
    c = choices[0]
    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
    return (1 if piece else 0), None


def run_one(
    base_url: str, backend: str, req: BenchRequest, model: str, timeout_s: float
) -> RequestResult:
    path, body = _payload(backend, req, model)
    result = RequestResult(input_len=len(req.input_ids))
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
                new, prompt_tokens = _chunk_tokens(backend, data, tokens)
                if prompt_tokens is not None:
                    result.input_len = prompt_tokens
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


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def _summary(values: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "mean": statistics.fmean(ms) if ms else 0.0,
        "median": statistics.median(ms) if ms else 0.0,
        "p95": _pct(ms, 95),
        "p99": _pct(ms, 99),
        "max": max(ms) if ms else 0.0,
    }


def compute_metrics(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    inp = sum(r.input_len for r in ok)
    out = sum(r.output_len for r in ok)
    return {
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
        (
            "Dataset",
            f"{args.dataset_name} (in {args.random_input_len}, out {args.random_output_len})",
        ),
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


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    base = args.base_url or f"http://{args.host}:{args.port}"
    info = _get_json(base + "/get_model_info")
    model = args.model or info.get("served_model_name") or "default"
    reqs = make_requests(args, int(info.get("vocab_size") or 32000))
    # Warm-up: full-length prompts, a few output tokens, sent as concurrently as the run will be,
    # so the prefill shapes the run hits are compiled before anything is timed.
    warm = [BenchRequest(r.input_ids, r.text, 4) for r in reqs[: args.warmup_requests]]
    if warm:
        with ThreadPoolExecutor(
            max_workers=min(len(warm), args.max_concurrency or len(warm))
        ) as pool:
            list(pool.map(lambda r: run_one(base, args.backend, r, model, args.timeout), warm))
    rng = random.Random(args.seed + 1)
    workers = args.max_concurrency or len(reqs) or 1
    results: list[RequestResult] = [RequestResult() for _ in reqs]
    lock = threading.Lock()

    def task(i: int) -> None:
        r = run_one(base, args.backend, reqs[i], model, args.timeout)
        with lock:
            results[i] = r

    start = time.perf_counter()
    futures: list[Future[None]] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i in range(len(reqs)):
            futures.append(pool.submit(task, i))
            if args.request_rate != float("inf") and i + 1 < len(reqs):
                time.sleep(rng.expovariate(args.request_rate))
        for f in futures:
            f.result()
    metrics = compute_metrics(results, time.perf_counter() - start)
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
    p.add_argument("--dataset-name", choices=("random", "fixed"), default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.5,
        help="random dataset: lengths uniform in [len * ratio, len].",
    )
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
