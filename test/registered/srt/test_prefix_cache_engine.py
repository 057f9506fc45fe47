"""The prefix cache through the offline Engine on CPU (a tiny DeepSeek V4 with two ratio-4
layers, token ids in and out), under eviction pressure: 96 requests in waves over a pool of 16
blocks of 32 tokens, drawn from 6 shared prefixes with their own suffixes.

- Each response says how many prompt tokens it resumed from the cache (``meta_info``), and
  their sum is the scheduler's count; repeated prefixes hit, evictions happen.
- The budget holds at every wave (running reservations + cached blocks <= the pool), the
  scheduler process's resident memory stays flat from the second wave on (nothing grows with
  the number of requests served), and ``Engine.flush_cache()`` on the idle engine returns every
  block and snapshot: rank 0's pool is back to all free.
The GPU-sized version (10,000 requests, RSS and free count over HTTP) is
``scripts/bench_prefix_cache.py --only leak``.

Under DP attention with expert parallelism (TP=2, DP=2, EP=2, gloo ranks) each group keeps its
own cache in its ranks' pool and a request goes to the group holding its prefix: the second
wave resumes in the groups the first wave filled, and the greedy tokens are TP=1's without the
cache.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sglang import Engine
from sglang.test.ci_register import register_cpu_ci
from sglang.test.prefix_cache_check import random_ids, tiny_dsv4_checkpoint
from sglang.test.run import run_this_file

register_cpu_ci(est_time=55)

WAVES, PER_WAVE, VOCAB = 8, 12, 128
# Growth of the scheduler's RSS allowed over the waves after the first: allocator noise, not
# per-request state (a leak of one snapshot or block table per request would exceed it by far).
RSS_SLACK = 64 << 20


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_engine_serves_from_the_cache_and_flushes_without_leaks(tmp_path: Path) -> None:
    path = tiny_dsv4_checkpoint(tmp_path / "dsv4", compress_ratios=[4, 4, 0])
    g = torch.Generator().manual_seed(0)
    prefixes = [random_ids(40 + 8 * i, VOCAB, g) for i in range(6)]
    greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    with Engine(
        model_path=path,
        skip_tokenizer_init=True,
        device="cpu",
        random_seed=0,
        log_level="warning",
        context_length=512,
        max_total_tokens=16 * 32,
        page_size=32,
        max_running_requests=6,
        max_state_snapshots=6,
        chunked_prefill_size=256,
    ) as e:
        info = e.get_server_info()["model_info"]
        assert info["prefix_cache"].startswith("on (radix tree over 32-token blocks"), info
        pid = e.tokenizer_manager.handle.procs[0].pid
        cached, rss = 0, []
        for wave in range(WAVES):
            prompts = [
                prefixes[(wave * 5 + i) % 6] + random_ids(5 + i, VOCAB, g) for i in range(PER_WAVE)
            ]
            results = e.generate(input_ids=prompts, sampling_params=greedy)
            cached += sum(r["meta_info"]["cached_tokens"] for r in results)
            stats = e.get_server_info()["scheduler"]
            assert stats["reserved_tokens"] + stats["cache_tokens"] <= stats["max_total_tokens"]
            rss.append(_rss(pid))
        stats = e.get_server_info()["scheduler"]
        print(f"cached {cached} of {stats['prompt_tokens']} prompt tokens; {stats}; rss {rss}")
        assert stats["cached_tokens"] == cached > 0
        assert stats["evicted_blocks"] > 0 and stats["num_active_caches"] == 0
        assert max(rss[1:]) - rss[1] < RSS_SLACK, rss
        assert e.flush_cache()["ok"]
        after = e.get_server_info()["scheduler"]
        assert after["free_blocks"] == after["total_blocks"] == 16
        assert after["cache_tokens"] == after["state_snapshots"] == 0


def test_dp_attention_with_ep_keeps_a_cache_per_group(tmp_path: Path) -> None:
    path = tiny_dsv4_checkpoint(tmp_path / "dsv4", compress_ratios=[4, 4, 0])
    g = torch.Generator().manual_seed(1)
    a, b = random_ids(70, VOCAB, g), random_ids(75, VOCAB, g)
    first = [a + random_ids(5, VOCAB, g), b + random_ids(6, VOCAB, g)]
    second = [a + random_ids(7, VOCAB, g), b + random_ids(3, VOCAB, g), a + random_ids(9, VOCAB, g)]
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    common = {
        "model_path": path,
        "skip_tokenizer_init": True,
        "device": "cpu",
        "random_seed": 0,
        "log_level": "warning",
        "context_length": 512,
        "max_total_tokens": 16 * 32,
        "page_size": 32,
        "max_running_requests": 4,
    }
    with Engine(**common, tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2) as e:
        info = e.get_server_info()["model_info"]
        assert info["prefix_cache"].startswith("on") and "caches paged" in info["cuda_graph"]
        results = e.generate(input_ids=first, sampling_params=greedy)
        results += e.generate(input_ids=second, sampling_params=greedy)
        assert [r["meta_info"]["cached_tokens"] for r in results] == [0, 0, 64, 64, 64]
        assert e.flush_cache()["ok"]
        stats = e.get_server_info()["scheduler"]
        assert stats["free_blocks"] == stats["total_blocks"]
    with Engine(**common, disable_radix_cache=True) as one:
        want = one.generate(input_ids=first, sampling_params=greedy)
        want += one.generate(input_ids=second, sampling_params=greedy)
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in want]


if __name__ == "__main__":
    run_this_file(__file__)
