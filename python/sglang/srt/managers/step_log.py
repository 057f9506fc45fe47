"""The scheduler's periodic activity line (rank 0, at most one every ``--log-stats-interval``
seconds, and only when steps ran).

Each line covers the steps since the last one, split by what they carried: decode-only steps
(one token per request: a CUDA-graph replay where one is captured), mixed steps (decode rows
beside prefill chunks) and prefill-only steps, with each kind's count and mean wall time, then
the generation throughput over the interval and the queue and cache state now, and with the
prefix cache its hit rate over the interval (cached of admitted prompt tokens), the blocks evicted
in it and the share of the token budget the cached blocks hold. A TPOT or TTFT that moves is then
readable from the log: which kind of step grew, or became more frequent, or whether the cache
stopped hitting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

KINDS = ("decode", "mixed", "prefill")


def step_kind(seq_lens: tuple[int, ...]) -> str:
    """A step's kind from its rows' lengths (a one-token row counts as a decode row)."""
    decode = sum(n == 1 for n in seq_lens)
    if decode == len(seq_lens):
        return "decode"
    return "mixed" if decode else "prefill"


@dataclass
class StepLog:
    interval_s: float  # least seconds between lines; 0: no lines
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    generated: int = 0
    started: float = field(default_factory=time.perf_counter)
    # The prefix cache's totals at the last line (its text shows what changed since).
    prefix_totals: tuple[int, int, int] = (0, 0, 0)

    def record(
        self, seq_lens: tuple[int, ...], seconds: float, generated: int, now: float | None = None
    ) -> bool:
        """Count one step (``generated`` tokens sampled); whether a line is due."""
        if self.interval_s <= 0 or not seq_lens:
            return False
        kind = step_kind(seq_lens)
        self.steps[kind] += 1
        self.seconds[kind] += seconds
        self.generated += generated
        now = time.perf_counter() if now is None else now
        return now - self.started >= self.interval_s

    def line(
        self, *, running: int, queued: int, token_usage: float, now: float | None = None
    ) -> str:
        """The line of the steps counted since the last one; starts the next interval."""
        now = time.perf_counter() if now is None else now
        kinds = ", ".join(
            f"{kind} {self.steps[kind]} at {1e3 * self.seconds[kind] / self.steps[kind]:.2f} ms"
            for kind in KINDS
            if self.steps[kind]
        )
        rate = self.generated / max(now - self.started, 1e-9)
        text = (
            f"{sum(self.steps.values())} steps ({kinds}); gen throughput {rate:.1f} tok/s; "
            f"running {running}, queued {queued}, token usage {token_usage:.2f}"
        )
        self.steps = dict.fromkeys(KINDS, 0)
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.generated, self.started = 0, now
        return text

    def prefix_cache_text(
        self, *, prompt_tokens: int, cached_tokens: int, evicted_blocks: int, cache_usage: float
    ) -> str:
        """The prefix cache's part of the line, from its totals since start: the hit rate and
        evictions since the last line, the budget share its blocks hold now."""
        last_prompt, last_cached, last_evicted = self.prefix_totals
        prompt, cached = prompt_tokens - last_prompt, cached_tokens - last_cached
        self.prefix_totals = (prompt_tokens, cached_tokens, evicted_blocks)
        rate = f"{cached / prompt:.1%}" if prompt else "n/a"
        return (
            f"prefix cache hit rate {rate} ({cached} of {prompt} prompt tokens), "
            f"{evicted_blocks - last_evicted} blocks evicted, cache usage {cache_usage:.2f}"
        )
