"""Prefix cache on the GPU: what it saves, what it costs, and that it does not leak. Each part
starts its own server(s) (``launch_server``, token ids in) and prints one table.

- ``ttft``: an 8192-token prompt whose first 7168 tokens are cached (the same 7168 tokens served
  just before) against the same prompt from an empty cache (``/flush_cache`` before each): TTFT
  median of ``--repeats``; goal cached/uncached <= 0.2. Wide DeepSeek V4 bench model
  (``bench_serving_h200``: hidden 4096, 256 experts, window 128, ratios 4/128), ``--layers``.
- ``workloads``: ``bench_serving``'s multi-turn workload (32 chats x 8 turns over a 1024-token
  system prompt, 256-token messages, 128-token answers) and a no-sharing one (random prompts)
  on a server with the cache and one with ``--disable-radix-cache``: the cached share of the
  reusable tokens (goal >= 90%) and the throughput on/off (goal: no-sharing >= 0.98; its
  prompts of 1024 .. 2048 tokens mostly end off a block edge, so each gets a chunk cut).
- ``leak``: 10,000 requests (64 shared prefixes of 300 .. 900 tokens plus their own 20 .. 80)
  through the built-in model on a pool of 32 blocks of 256 tokens (eviction all the time): the
  scheduler's resident memory every 1000 requests (goal: flat) and, after ``/flush_cache``,
  rank 0's pool all free.

Usage: python scripts/bench_prefix_cache.py [--only ttft,workloads,leak] [--layers 2]
       [--ttft-model wide|builtin] [--model-dir DIR] [--keep-model] [--log-dir DIR]
``workloads`` and ``leak`` (and ``ttft`` with ``--ttft-model builtin``) also run without a GPU.
About 1.5 minutes for ttft (generation 30 s), 3 for workloads, 2 for leak, on one H200.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from statistics import median
from typing import Any

import torch

from bench_serving_h200 import add_bench_model_args, build_model
from sglang.bench_server import launched_server
from sglang.bench_serving import build_parser, run_benchmark, run_one
from sglang.bench_workloads import BenchRequest

PORT = 30131


def _get(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
        data: dict[str, Any] = json.loads(r.read())
    return data


def _post(port: int, path: str) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@contextmanager
def server(model: str | None, flags: Sequence[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--port", str(PORT)]
    if model is not None:
        cmd += ["--model-path", model, "--skip-tokenizer-init"]
    cmd += ["--log-level", "info", "--log-stats-interval", "5", *flags]
    with launched_server(cmd, PORT, log, fact="prefix cache:") as proc:
        yield proc


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(16, vocab) for _ in range(n)]


def _ttft(ids: list[int], out: int = 1) -> tuple[float, int]:
    r = run_one(f"http://127.0.0.1:{PORT}", "sglang", BenchRequest(ids, "", out), "m", 600)
    if not r.ok:
        raise RuntimeError(r.error)
    return r.ttft, r.cached_len


def part_ttft(args: argparse.Namespace, log_dir: Path) -> None:
    builtin = args.ttft_model == "builtin"
    # The built-in model's context is 4096: 4000 tokens of which 3584 (14 blocks) are cached.
    total, cached_len = (4000, 3584) if builtin else (8192, 7168)
    model_dir = Path(args.model_dir)
    if not builtin:
        build_model(model_dir, args.layers, max_positions=16384)
        torch.cuda.empty_cache()
    flags = ["--context-length", "4096" if builtin else "16384", "--max-running-requests", "8"]
    if builtin:  # a shared block pool (the cache lives in it) on any device
        flags += ["--max-total-tokens", "32768"]
    try:
        with server(None if builtin else str(model_dir), flags, log_dir / "prefix_ttft.log"):
            vocab = int(_get(PORT, "/get_model_info")["vocab_size"])
            rng = random.Random(0)
            # Warm-up: both prefill shapes (whole prompt from empty, the tail after a hit).
            for _ in range(2):
                warm = _ids(rng, total, vocab)
                _post(PORT, "/flush_cache")
                _ttft(warm[:cached_len])
                _ttft(warm)
            cold, hot = [], []
            for _ in range(args.repeats):
                prompt = _ids(rng, total, vocab)
                _post(PORT, "/flush_cache")
                t, cached = _ttft(prompt)
                assert cached == 0, cached
                cold.append(t)
                _post(PORT, "/flush_cache")
                _ttft(prompt[:cached_len])  # caches the prefix (a snapshot at its end)
                t, cached = _ttft(prompt)
                assert cached == cached_len, cached
                hot.append(t)
    finally:
        if not args.keep_model and not builtin:
            shutil.rmtree(model_dir, ignore_errors=True)
    a, b = median(hot) * 1e3, median(cold) * 1e3
    what = "the built-in model" if builtin else f"wide DeepSeek V4 ({args.layers} layers), bf16"
    print(f"\nTTFT of a {total}-token prompt, {what}")
    head = f"first {cached_len} tokens"
    print(f"| {head} | TTFT ms (median) |")
    print(f"|{'-' * (len(head) + 2)}|-----------------:|")
    print(f"| {'cached':<{len(head)}} | {a:16.1f} |\n| {'not cached':<{len(head)}} | {b:16.1f} |")
    print(f"cached / uncached = {a / b:.3f} (goal <= 0.2)")


def _bench(flags: list[str]) -> dict[str, Any]:
    args = build_parser().parse_args(["--port", str(PORT), "--warmup-requests", "0", *flags])
    return run_benchmark(args)


def part_workloads(args: argparse.Namespace, log_dir: Path) -> None:
    chat = ["--dataset-name", "multi-turn", "--multi-turn-conversations", "32"]
    chat += ["--multi-turn-turns", "8", "--max-concurrency", "32"]
    # random lengths in [1024, 2048]: most prompts end off a block edge (a chunk cut each)
    solo = ["--dataset-name", "random", "--num-prompts", "256", "--random-input-len", "2048"]
    solo += ["--random-output-len", "128", "--random-range-ratio", "0.5"]
    solo += ["--max-concurrency", "32"]
    flags = ["--context-length", "4096", "--max-running-requests", "32"]  # the built-in max
    if not torch.cuda.is_available():  # a shared block pool (the cache lives in it) on the CPU
        flags += ["--max-total-tokens", str(32 * 4096)]
    results: dict[str, dict[str, Any]] = {}
    for label, extra in (("on", []), ("off", ["--disable-radix-cache"])):
        with server(None, flags + extra, log_dir / f"prefix_workloads_{label}.log"):
            _bench(["--dataset-name", "fixed", "--num-prompts", "32", "--random-input-len", "2048"])
            _post(PORT, "/flush_cache")
            results[f"chat {label}"] = _bench(chat)
            _post(PORT, "/flush_cache")
            results[f"solo {label}"] = _bench(solo)
    print("\nBuilt-in model: multi-turn (32 chats x 8 turns), no-sharing (256 x 1024-2048 in)")
    print("| workload, cache | hit/reusable | hit/input | TTFT ms | out tok/s | total tok/s |")
    print("|-----------------|-------------:|----------:|--------:|----------:|------------:|")
    for label, m in results.items():
        print(
            f"| {label:<15} | {m['reusable_hit_rate']:12.1%} | {m['cache_hit_rate']:9.1%} | "
            f"{m['ttft_ms']['median']:7.1f} | {m['output_throughput']:9.1f} | "
            f"{m['total_throughput']:11.1f} |"
        )
    for w in ("chat", "solo"):
        on, off = results[f"{w} on"], results[f"{w} off"]
        ratio = on["total_throughput"] / max(off["total_throughput"], 1e-9)
        print(f"{w}: throughput on/off {ratio:.3f}")
    print("goals: chat hit of reusable >= 90%; solo throughput on/off >= 0.98")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def part_leak(args: argparse.Namespace, log_dir: Path) -> None:
    flags = ["--context-length", "2048", "--max-total-tokens", str(32 * 256)]
    flags += ["--max-running-requests", "16", "--page-size", "256"]
    with server(None, flags, log_dir / "prefix_leak.log"):
        vocab = int(_get(PORT, "/get_model_info")["vocab_size"])
        rng = random.Random(1)
        prefixes = [_ids(rng, rng.randint(300, 900), vocab) for _ in range(64)]
        rank0 = int(_get(PORT, "/server_info")["scheduler_pids"][0])
        rss: list[float] = []
        cached = 0
        per_block = max(1, args.leak_requests // 10)
        for block in range(10):
            reqs = [
                BenchRequest(rng.choice(prefixes) + _ids(rng, rng.randint(20, 80), vocab), "", 2)
                for _ in range(per_block)
            ]
            with ThreadPoolExecutor(max_workers=32) as pool:
                done = list(
                    pool.map(
                        lambda r: run_one(f"http://127.0.0.1:{PORT}", "sglang", r, "m", 600), reqs
                    )
                )
            failed = [r.error for r in done if not r.ok]
            assert not failed, failed[:3]
            cached += sum(r.cached_len for r in done)
            rss.append(_rss_mib(rank0))
            print(f"  {per_block * (block + 1)} requests: scheduler RSS {rss[-1]:.0f} MiB")
        stats = _get(PORT, "/server_info")["scheduler"]
        status, text = _post(PORT, "/flush_cache")
        after = _get(PORT, "/server_info")["scheduler"]
    print(f"\n{10 * per_block} requests on a 32-block pool (64 prefixes): eviction throughout")
    prompt = stats["prompt_tokens"]
    print(
        f"cached tokens {cached} of {prompt} ({cached / max(prompt, 1):.1%}), evicted blocks "
        f"{stats['evicted_blocks']}, evicted snapshots {stats['evicted_snapshots']}"
    )
    print(f"scheduler RSS MiB per {per_block} requests: {[round(x) for x in rss]}")
    print(f"RSS growth after the first {per_block}: {rss[-1] - rss[0]:.1f} MiB (goal: flat)")
    print(f"/flush_cache: {status} {text}")
    print(
        f"pool after flush: {after['free_blocks']} of {after['total_blocks']} blocks free, "
        f"{after['state_snapshots']} snapshots, {after['cache_tokens']} cached tokens (goal: all "
        "free, 0, 0)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="ttft,workloads,leak")
    add_bench_model_args(parser, layers=2)
    parser.add_argument(
        "--ttft-model",
        choices=("wide", "builtin"),
        default="wide",
        help="ttft part: the wide DeepSeek V4 bench model (GPU), or the built-in model (any "
        "device; a 4000-token prompt whose first 3584 tokens are cached).",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--leak-requests", type=int, default=10_000, help="leak part: requests")
    args = parser.parse_args()
    parts = {"ttft": part_ttft, "workloads": part_workloads, "leak": part_leak}
    chosen = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in chosen if p not in parts]
    if bad:
        parser.error(f"--only: unknown parts {bad}; choose from {sorted(parts)}")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        started = time.perf_counter()
        parts[name](args, log_dir)
        print(f"[{name}: {time.perf_counter() - started:.0f}s]\n")


if __name__ == "__main__":
    main()
