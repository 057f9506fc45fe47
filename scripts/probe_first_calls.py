"""Why the first requests after startup are slow: time the first and second forward at each
prefill token count the serving benchmark's batches produce, after the server's start-up warm-up.

Builds the 1-layer wide DeepSeek V4 serving model (``bench_serving_h200.model_config(1)``, random
weights on the GPU), runs what ``ModelRunner.warmup`` runs (``--warmup-sizes`` picks the old
16-token warm-up or the token-count buckets of ``warmup_token_counts``), then prefills fresh
requests of ``T`` tokens twice each. A first call far slower than the second is a compile (Triton
JIT of a new kernel variant) inside what would be a timed request. Point ``TRITON_CACHE_DIR`` at
an empty directory so the disk cache does not hide it.
Usage: TRITON_CACHE_DIR=$(mktemp -d) python scripts/probe_first_calls.py
       [--warmup-sizes old|buckets]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench_serving_h200 import model_config
from sglang.srt.model_executor.warmup_plan import warmup_token_counts
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig

# Batches of 256-token prompts (1..16 at once), mixed steps (prompts plus decode rows), and
# counts off the warm-up grid.
PROBE_TOKENS = (
    1,
    16,
    256,
    257,
    300,
    512,
    768,
    1000,
    1024,
    1280,
    1500,
    2048,
    2056,
    2500,
    3072,
    3500,
    4000,
    4095,
)


def _forward_s(model: DeepseekV4ForCausalLM, n: int) -> float:
    ids = torch.arange(n, device="cuda") % model.config.vocab_size
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model(ids, torch.arange(n, device="cuda"))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--warmup-sizes", choices=("old", "buckets"), default="old")
    parser.add_argument("--chunk", type=int, default=8192)
    args = parser.parse_args()
    cfg = DeepseekV4ModelConfig.from_dict(model_config(1))
    model = DeepseekV4ForCausalLM(cfg, dtype=torch.bfloat16, device="cuda", moe_runner="triton")
    gen = torch.Generator("cuda").manual_seed(0)
    for name, p in model.named_parameters():
        p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * (p.shape[-1] ** -0.5))
    from profile_decode import load_random_experts

    load_random_experts(model.decoder_layers[0].ffn.experts, gen)
    limit = min(args.chunk, cfg.max_position_embeddings - 1)
    sizes = [16] if args.warmup_sizes == "old" else warmup_token_counts(limit)
    t0 = time.perf_counter()
    for n in sizes:
        _forward_s(model, n)
    warm_s = time.perf_counter() - t0
    print(f"warm-up ({args.warmup_sizes}: {len(sizes)} forwards {sizes}) took {warm_s:.1f} s")
    print(f"{'tokens':>7} {'first ms':>10} {'second ms':>10}")
    for n in PROBE_TOKENS:
        first, second = _forward_s(model, n), _forward_s(model, n)
        print(f"{n:>7} {first * 1e3:>10.1f} {second * 1e3:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
