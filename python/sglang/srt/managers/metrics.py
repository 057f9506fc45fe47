"""Prometheus metrics of the server (``--enable-metrics``), named like SGLang's (``sglang:``).

Counters and histograms are updated by the tokenizer manager as requests progress; the queue
gauges are refreshed from the scheduler's stats when /metrics is scraped. Each server owns its own
registry, so several engines in one process (tests) never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sglang.srt.managers.io_struct import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        # Every metric carries the model_name label and lives in this server's registry.
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.requests = Counter(
            "sglang:num_requests",
            "Requests finished, by how they ended.",
            [*labels, "finish"],
            registry=r,
        )
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of finished requests.")
        self.cached_tokens = counter(
            "sglang:cached_tokens",
            "Prompt tokens of finished requests served from the prefix cache.",
        )
        self.cache_hit_rate = gauge(
            "sglang:cache_hit_rate",
            "Share of admitted prompt tokens served from the prefix cache, since start (0..1).",
        )
        self.cache_usage = gauge(
            "sglang:cache_usage", "Share of --max-total-tokens the prefix cache's blocks hold."
        )
        self.evicted_blocks = counter(
            "sglang:radix_cache_evicted_blocks", "Cache blocks the prefix cache evicted."
        )
        self.evicted_snapshots = counter(
            "sglang:radix_cache_evicted_snapshots", "State snapshots the prefix cache evicted."
        )
        self._evicted = (0, 0)  # the scheduler's totals at the last scrape
        self.generation_tokens = counter("sglang:generation_tokens", "Generated tokens.")
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds",
            "Time between consecutive outputs of a request.",
            _ITL_BUCKETS,
        )
        self.running = gauge("sglang:num_running_reqs", "Requests admitted and running.")
        self.queued = gauge("sglang:num_queue_reqs", "Requests waiting for admission.")
        self.token_usage = gauge(
            "sglang:token_usage", "Reserved share of --max-total-tokens (0..1)."
        )
        self.active_caches = gauge(
            "sglang:num_active_request_caches", "Per-request model caches held."
        )
        self.labels = {"model_name": model_name}

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(**self.labels).observe(seconds)

    def tokens(self, n: int, gap_s: float | None) -> None:
        self.generation_tokens.labels(**self.labels).inc(n)
        if gap_s is not None:
            self.itl.labels(**self.labels).observe(gap_s)

    def finished(
        self, finish: str, e2e_s: float, prompt_tokens: int, cached_tokens: int = 0
    ) -> None:
        self.requests.labels(**self.labels, finish=finish).inc()
        self.prompt_tokens.labels(**self.labels).inc(prompt_tokens)
        self.cached_tokens.labels(**self.labels).inc(cached_tokens)
        self.e2e.labels(**self.labels).observe(e2e_s)

    def scheduler(self, stats: SchedulerStats) -> None:
        self.running.labels(**self.labels).set(stats.num_running_reqs)
        self.queued.labels(**self.labels).set(stats.num_waiting_reqs)
        self.token_usage.labels(**self.labels).set(
            stats.reserved_tokens / max(1, stats.max_total_tokens)
        )
        self.active_caches.labels(**self.labels).set(stats.num_active_caches)
        rate = stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
        self.cache_hit_rate.labels(**self.labels).set(rate)
        self.cache_usage.labels(**self.labels).set(
            stats.cache_tokens / max(1, stats.max_total_tokens)
        )
        blocks, snapshots = self._evicted
        self.evicted_blocks.labels(**self.labels).inc(max(0, stats.evicted_blocks - blocks))
        self.evicted_snapshots.labels(**self.labels).inc(
            max(0, stats.evicted_snapshots - snapshots)
        )
        self._evicted = (stats.evicted_blocks, stats.evicted_snapshots)

    def render(self) -> bytes:
        return generate_latest(self.registry)
