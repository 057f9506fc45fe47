"""Load and fault run against ``launch_server`` on loopback: waves of concurrent streams, then a
scheduler rank killed on purpose. Starts its own server (the built-in model on CPU unless flags
say otherwise) and stops it.

Each wave sends ``N`` requests at once over the three streaming endpoints (``/v1/completions``,
``/v1/chat/completions``, ``/generate``), with mixed prompt and output lengths; a share of the
clients disconnect after a few chunks, and a share of the requests are malformed (out-of-range
seed, lone surrogate, deep JSON, unknown model, max_tokens over the context ...). Meanwhile
``/health`` is polled. Every request ends in exactly one bucket:

- ``completed``: the stream ended with a finish_reason and ``[DONE]``;
- ``rejected``: a malformed request answered with the expected 4xx JSON error;
- ``disconnected``: the client left on purpose (the server must free it: ``leftover`` counts
  requests or caches still held on the server after the wave);
- ``failed``: an error answer to a good request (or a malformed one answered wrongly);
- ``truncated``: a stream that ended without a finish_reason or ``[DONE]``;
- ``lost``: no answer at all (connection error, timeout).

Per wave: p50/p99 TTFT and ITL of the completed streams, the largest gap between two chunks of
any stream (max stall), the slowest /health, and RSS of the server and of all its processes.
Last: ``--kill-streams`` long streams in flight, one rank SIGKILLed: each must end with an error
event and ``[DONE]``, and the server must exit non-zero within seconds.

Usage: python scripts/load_and_fault.py [--waves 64,128,256] [--tp-size 2] [--seed 0]
       [--disconnect-share 0.1] [--malformed-share 0.1] [--kill-rank -1] [--json out.json]
       [-- extra launch_server flags]
About 2-3 minutes on a 2-core CPU machine with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from sglang.bench_serving import percentile
from sglang.bench_table import markdown_table
from sglang.bench_workloads import WORDS
from sglang.test.server_process import ServerProcess

MODEL = "sglang-default-tiny-dsv4"


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# --- requests -------------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # completed / rejected / disconnected / failed / truncated / lost
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    detail: str = ""


def _malformed(rng: random.Random) -> tuple[str, bytes, int]:
    """(path, raw body, expected status)."""
    cases = [
        (
            "/v1/completions",
            b'{"prompt": "hi", "max_tokens": 2, "seed": 18446744073709551616}',
            400,
        ),
        ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 2}', 400),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
        ("/v1/completions", b'{"x":' + b"[" * 20000, 400),
        ("/v1/completions", b'{"model": "gpt-4", "prompt": "hi"}', 404),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1000000000}', 400),
        ("/v1/completions", b'{"prompt": "hi", "temperature": 1e9}', 400),
        ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400),
        ("/generate", b'{"text": "hi", "sampling_params": {"top_k": -5}}', 400),
        ("/generate", b'{"text": "hi"', 400),
        ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400),
    ]
    return rng.choice(cases)


def _good_body(rng: random.Random, stream: bool = True) -> tuple[str, dict[str, Any]]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 16, 64, 256))))
    out_len = rng.choice((4, 8, 16, 32, 64))
    kind = rng.randrange(3)
    if kind == 0:
        return "/v1/completions", {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": out_len,
            "ignore_eos": True,
            "stream": stream,
        }
    if kind == 1:
        return "/v1/chat/completions", {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": out_len,
            "ignore_eos": True,
            "stream": stream,
        }
    return "/generate", {
        "text": prompt,
        "stream": stream,
        "sampling_params": {"max_new_tokens": out_len, "ignore_eos": True},
    }


def _role_only(event: dict[str, Any]) -> bool:
    choices = event.get("choices") or [{}]
    return all("role" in (c.get("delta") or {}) and not c.get("finish_reason") for c in choices)


def _finished(path: str, event: dict[str, Any]) -> bool:
    if path == "/generate":
        return event.get("meta_info", {}).get("finish_reason") is not None
    return any(c.get("finish_reason") for c in event.get("choices", []))


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], leave_after: int | None
) -> Outcome:
    t0 = time.perf_counter()
    out = Outcome("truncated")
    last: float | None = None
    done = finished = False
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Outcome("failed", detail=f"{resp.status_code} {resp.text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return Outcome("failed", detail=str(event["error"])[:200])
                if _role_only(event):
                    continue  # chat's first chunk is sent before the request is scheduled
                if out.ttft is None:
                    out.ttft = now - t0
                elif last is not None:
                    out.itls.append(now - last)
                last = now
                chunks += 1
                finished = finished or _finished(path, event)
                if leave_after is not None and chunks >= leave_after:
                    out.kind = "disconnected"
                    return out  # leaving the context manager closes the connection
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Outcome("lost", detail=f"{type(exc).__name__}: {exc}"[:200])
    out.kind = "completed" if done and finished else "truncated"
    return out


async def _bad(client: httpx.AsyncClient, case: tuple[str, bytes, int]) -> Outcome:
    path, raw, status = case
    try:
        r = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
    except httpx.HTTPError as exc:
        return Outcome("lost", detail=f"{type(exc).__name__}: {exc}"[:200])
    try:
        ok = r.status_code == status and isinstance(r.json()["error"]["message"], str)
    except (ValueError, KeyError, TypeError):
        ok = False
    return Outcome("rejected" if ok else "failed", detail=f"{path} -> {r.status_code}")


async def _poll_health(client: httpx.AsyncClient, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            await client.get("/health")
        except httpx.HTTPError:
            pass
        out.append(time.perf_counter() - t0)
        await asyncio.sleep(0.05)


async def _wave(
    base: str, n: int, rng: random.Random, args: argparse.Namespace, pids: list[int]
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    timeout = httpx.Timeout(args.request_timeout)
    async with (
        httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as client,
        httpx.AsyncClient(base_url=base, timeout=30) as health_client,
    ):
        tasks = []
        for _ in range(n):
            x = rng.random()
            if x < args.malformed_share:
                tasks.append(_bad(client, _malformed(rng)))
            else:
                path, body = _good_body(rng)
                leave = (
                    rng.randint(1, 3) if x < args.malformed_share + args.disconnect_share else None
                )
                tasks.append(_stream(client, path, body, leave))
        stop = asyncio.Event()
        health: list[float] = []
        poller = asyncio.create_task(_poll_health(health_client, stop, health))
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        stop.set()
        await poller
        leftover = await _leftover(health_client)
    counts = {
        k: 0 for k in ("completed", "rejected", "disconnected", "failed", "truncated", "lost")
    }
    for o in outcomes:
        counts[o.kind] += 1
    done = [o for o in outcomes if o.kind == "completed"]
    ttft = [o.ttft for o in done if o.ttft is not None]
    itl = [x for o in done for x in o.itls]
    stalls = [max(o.itls) for o in outcomes if o.itls]
    rss = [_rss_kib(p) for p in pids]
    problems = [o.detail for o in outcomes if o.kind in ("failed", "truncated", "lost")][:5]
    return {
        "concurrency": n,
        **counts,
        "leftover": leftover,
        "wall_s": wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50, math.nan),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99, math.nan),
        "itl_p50_ms": 1e3 * percentile(itl, 50, math.nan),
        "itl_p99_ms": 1e3 * percentile(itl, 99, math.nan),
        "max_stall_ms": 1e3 * max(stalls, default=0.0),
        "health_max_ms": 1e3 * max(health, default=0.0),
        "rss_server_mib": rss[0] / 1024 if rss else 0.0,
        "rss_total_mib": sum(rss) / 1024,
        "problems": problems,
    }


async def _leftover(client: httpx.AsyncClient) -> int:
    """Requests or caches the server still holds once every client is done (should be 0)."""
    deadline = time.monotonic() + 15
    held = -1
    while time.monotonic() < deadline:
        info = (await client.get("/server_info")).json()
        sched = info["scheduler"]
        held = sched["num_running_reqs"] + sched["num_waiting_reqs"] + sched["num_active_caches"]
        held += info["num_requests_in_flight"]
        if held == 0:
            return 0
        await asyncio.sleep(0.2)
    return held


async def _big_prompt_stall(base: str) -> dict[str, float]:
    """The largest chunk gap of a running stream and the slowest /health while a 5 MB prompt is
    sent and rejected."""
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        gaps: list[float] = []
        health: list[float] = []
        stop = asyncio.Event()

        async def stream() -> None:
            body = {
                "model": MODEL,
                "prompt": "Once",
                "max_tokens": 3000,
                "ignore_eos": True,
                "stream": True,
            }
            last = None
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if stop.is_set():
                        break
                    if line.startswith("data: "):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now

        task = asyncio.create_task(stream())
        poller = asyncio.create_task(_poll_health(client, stop, health))
        await asyncio.sleep(1.0)
        t0 = time.perf_counter()
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 2**20})
        reject_s = time.perf_counter() - t0
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(task, poller)
    return {
        "status": r.status_code,
        "reject_ms": 1e3 * reject_s,
        "max_stream_gap_ms": 1e3 * max(gaps, default=0.0),
        "health_max_ms": 1e3 * max(health, default=0.0),
    }


async def _kill_rank(
    base: str, proc: subprocess.Popen[Any], pids: list[int], n: int, rank: int
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:
        firsts = [asyncio.Event() for _ in range(n)]

        async def one(i: int) -> str:
            body = {
                "model": MODEL,
                "prompt": "Once upon a time",
                "max_tokens": 3000,
                "ignore_eos": True,
                "stream": True,
            }
            error = done = False
            try:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            firsts[i].set()
                            if line == "data: [DONE]":
                                done = True
                            elif "error" in json.loads(line[6:]):
                                error = True
            except httpx.HTTPError:
                return "lost"
            finally:
                firsts[i].set()
            if error and done:
                return "ended_with_error"
            return "completed" if done else "truncated"

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
        victim = pids[rank]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        streams_ended_s = time.monotonic() - t0
    code = None
    while code is None and time.monotonic() - t0 < 60:
        code = proc.poll()
        await asyncio.sleep(0.05)
    out: dict[str, Any] = {
        k: results.count(k) for k in ("ended_with_error", "completed", "truncated", "lost")
    }
    out.update(
        in_flight=n,
        killed_rank=rank % len(pids),
        streams_ended_s=streams_ended_s,
        server_exit_code=code,
        server_exit_s=time.monotonic() - t0,
    )
    return out


# --- main -----------------------------------------------------------------------------------------


def _start_server(args: argparse.Namespace, extra: list[str]) -> ServerProcess:
    flags = ["--tp-size", str(args.tp_size), "--random-seed", str(args.seed), *extra]
    if "--device" not in extra:
        flags += ["--device", "cpu"]
    return ServerProcess(*flags, startup_timeout_s=300)


def _table(waves: list[dict[str, Any]]) -> str:
    cols = [
        ("concurrency", "{:d}"),
        ("completed", "{:d}"),
        ("rejected", "{:d}"),
        ("disconnected", "{:d}"),
        ("failed", "{:d}"),
        ("truncated", "{:d}"),
        ("lost", "{:d}"),
        ("leftover", "{:d}"),
        ("ttft_p50_ms", "{:.0f}"),
        ("ttft_p99_ms", "{:.0f}"),
        ("itl_p50_ms", "{:.1f}"),
        ("itl_p99_ms", "{:.1f}"),
        ("max_stall_ms", "{:.0f}"),
        ("health_max_ms", "{:.0f}"),
        ("rss_server_mib", "{:.0f}"),
        ("rss_total_mib", "{:.0f}"),
    ]
    rows = [[f.format(w[c]) for c, f in cols] for w in waves]
    return markdown_table([c for c, _ in cols], rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waves", default="64,128,256", help="concurrent requests per wave")
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disconnect-share", type=float, default=0.1)
    p.add_argument("--malformed-share", type=float, default=0.1)
    p.add_argument("--kill-streams", type=int, default=16, help="streams in flight at the kill")
    p.add_argument("--kill-rank", type=int, default=-1, help="rank to SIGKILL (-1: the last)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args(argv)
    waves_n = [int(x) for x in args.waves.split(",") if x]
    if any(not 1 <= n <= 1024 for n in waves_n):
        raise SystemExit("--waves: each wave must be 1..1024 requests")
    rng = random.Random(args.seed)
    server = _start_server(args, extra)
    proc, base = server.proc, server.base_url
    report: dict[str, Any] = {"waves": []}
    try:
        info = httpx.get(base + "/server_info", timeout=30).json()
        pids = [proc.pid, *info["scheduler_pids"]]
        for n in waves_n:
            wave = asyncio.run(_wave(base, n, rng, args, pids))
            report["waves"].append(wave)
            print(
                f"wave {n}: "
                + ", ".join(
                    f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in wave.items()
                ),
                flush=True,
            )
        report["big_prompt"] = asyncio.run(_big_prompt_stall(base))
        print(f"5 MB prompt: {report['big_prompt']}", flush=True)
        report["kill"] = asyncio.run(
            _kill_rank(base, proc, info["scheduler_pids"], args.kill_streams, args.kill_rank)
        )
        print(f"rank kill: {report['kill']}", flush=True)
    finally:
        report["server_log_tail"] = server.logs()[-2000:]
        server.stop()
    print()
    print(_table(report["waves"]))
    kill = report["kill"]
    print(
        f"\n5 MB prompt rejected with {report['big_prompt']['status']} in "
        f"{report['big_prompt']['reject_ms']:.0f} ms; meanwhile the largest stream gap was "
        f"{report['big_prompt']['max_stream_gap_ms']:.0f} ms and the slowest /health "
        f"{report['big_prompt']['health_max_ms']:.0f} ms"
    )
    print(
        f"rank {kill['killed_rank']} SIGKILLed with {kill['in_flight']} streams in flight: "
        f"{kill['ended_with_error']} ended with an error event and [DONE], {kill['truncated']} "
        f"truncated, {kill['lost']} lost; server exited with code {kill['server_exit_code']} "
        f"{kill['server_exit_s']:.1f} s after the kill"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    bad = sum(w["lost"] + w["truncated"] + w["failed"] + w["leftover"] for w in report["waves"])
    bad += kill["lost"] + kill["truncated"] + (kill["server_exit_code"] in (None, 0))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
