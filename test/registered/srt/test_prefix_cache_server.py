"""The prefix cache over HTTP (the built-in model on CPU, --max-total-tokens and --page-size 128
so caches are paged): OpenAI responses say how many prompt tokens came from the cache
(``usage.prompt_tokens_details.cached_tokens``), so does ``/generate`` (``meta_info``),
``/metrics`` exports the hit rate and the cached tokens, the activity line reports the hit rate,
``/flush_cache`` empties the cache (the next request misses, the pool is all free again), and
``bench_serving``'s generated-shared-prefix and multi-turn workloads report the cached share of
their reusable tokens (a group's system prompt, a chat's history) from the responses."""

from __future__ import annotations

import re

import httpx

from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file
from sglang.test.server_process import ServerProcess

register_cpu_ci(est_time=40)

TEXT = "The quick brown fox jumps over the lazy dog. " * 12  # 132 tokens


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def _bench(base: str, dataset: str, *flags: str) -> dict:
    from sglang.bench_serving import build_parser, run_benchmark

    common = ["--base-url", base, "--dataset-name", dataset, "--warmup-requests", "0"]
    args = build_parser().parse_args([*common, "--max-concurrency", "1", *flags])
    m = run_benchmark(args)
    assert m["failed"] == 0, m["errors"]
    return m


def test_http_reports_cached_tokens_flushes_and_exports_metrics() -> None:
    server = ServerProcess(
        "--device", "cpu", "--random-seed", "0", "--context-length", "1024",
        "--max-total-tokens", "2048", "--page-size", "128", "--max-running-requests", "4",
        "--enable-metrics", "--log-stats-interval", "0.01",
    )  # fmt: skip
    try:
        base = server.base_url
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]

        def complete(suffix: str) -> dict:
            body = {"model": model, "prompt": TEXT + suffix, "max_tokens": 2, "temperature": 0}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["usage"]

        first, second = complete(" one"), complete(" two")
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["prompt_tokens_details"]["cached_tokens"] == 128
        body = {"text": TEXT + " three", "sampling_params": {"max_new_tokens": 2}}
        native = httpx.post(f"{base}/generate", json=body, timeout=120).json()
        assert native["meta_info"]["cached_tokens"] == 128
        metrics = httpx.get(f"{base}/metrics").text
        assert _metric(metrics, "sglang:cached_tokens_total") == 256
        prompt = _metric(metrics, "sglang:prompt_tokens_total")
        assert _metric(metrics, "sglang:cache_hit_rate") == 256 / prompt
        assert _metric(metrics, "sglang:radix_cache_evicted_blocks_total") == 0
        flushed = httpx.post(f"{base}/flush_cache")
        assert flushed.status_code == 200 and "flushed" in flushed.json()["message"]
        info = httpx.get(f"{base}/server_info").json()
        stats = info["scheduler"]
        assert stats["free_blocks"] == stats["total_blocks"] > 0 and stats["cache_tokens"] == 0
        assert info["model_info"]["prefix_cache"].startswith("on (radix tree over 128-token")
        assert complete(" four")["prompt_tokens_details"]["cached_tokens"] == 0
        gsp_flags = ("--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "140")
        gsp_flags += ("--gsp-question-len", "10", "--gsp-output-len", "2")
        gsp = _bench(base, "generated-shared-prefix", "--gsp-num-groups", "2", *gsp_flags)
        # 4 of the 6 prompts resume from their group's first at 128 of its 140 shared tokens
        assert gsp["total_reusable_tokens"] == 4 * 140
        assert gsp["total_cached_tokens"] == 4 * 128, gsp
        chat = ("--multi-turn-conversations", "2", "--multi-turn-turns", "3")
        chat += ("--multi-turn-system-len", "130", "--multi-turn-message-len", "10")
        chats = _bench(base, "multi-turn", *chat, "--multi-turn-output-len", "4")
        assert chats["completed"] == 6 and chats["reusable_hit_rate"] > 0.8, chats
        assert "prefix cache hit rate" in server.logs()  # the activity line
    finally:
        server.stop()


if __name__ == "__main__":
    run_this_file(__file__)
