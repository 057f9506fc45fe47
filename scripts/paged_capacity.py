"""Max concurrent requests on one GPU before (whole-context slots) and after (paged blocks), from
the server's own memory budget (no GPU needed): one table.

The memory left for the cache is what the server computes (``memory_budget``): the
``--mem-fraction-static`` share of the GPU minus the weights, minus the step workspace (the
logits of ``--max-logit-rows-per-step`` rows, ``--logit-rows`` here) and the
window rings of ``--max-running-requests``; ``max_total_tokens`` is that over the bytes a cached
token costs. Before (the unpaged slot pool): every slot reserved a whole context, so
``min(max running, total // context length)`` requests ran whatever their length
(``block_admission.slot_concurrency``). After (the paged pool the server runs now): the entries live
in ``total // block`` blocks and a request reserves ``ceil((prompt + max new) / block)`` of them
(``SchedulePolicy`` with ``block_tokens``), so ``min(max running, total // that)`` run
(``block_admission.block_concurrency``). Model: ``bench_serving_h200.model_config(--layers)`` (the
wide DSv4 bench model), bf16.
Usage: PYTHONPATH=python:scripts python scripts/paged_capacity.py [--layers 4]
       [--request-tokens 1024,8192] [--contexts 8192,16384,65536] [--gpu-gib 139.8]
       [--room-gib G] (a cache room instead of the GPU minus the bench model's weights)
"""

from __future__ import annotations

import argparse
import math

from bench_serving_h200 import model_config
from sglang.bench_table import markdown_table
from sglang.srt.default_model.generate import parameter_shapes
from sglang.srt.mem_cache.block_admission import block_concurrency, slot_concurrency
from sglang.srt.model_executor.memory_budget import CacheShape, max_total_tokens_for_memory
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.server_args import default_max_logit_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--request-tokens", default="1024,8192", help="live lengths (prompt+new)")
    parser.add_argument("--contexts", default="8192,16384,65536")
    parser.add_argument("--gpu-gib", type=float, default=139.8)
    parser.add_argument("--mem-fraction", type=float, default=0.85)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--logit-rows", type=int, default=None, help="default: the server's")
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--room-gib", type=float, default=None, help="cache room, not weights")
    args = parser.parse_args()
    logit_rows = args.logit_rows or default_max_logit_rows(args.max_running)
    raw = model_config(args.layers)
    weights = 2 * sum(math.prod(s) for s in parameter_shapes(raw).values())
    room = int(args.gpu_gib * (1 << 30) * args.mem_fraction) - weights
    if args.room_gib is not None:  # a model whose weights this script does not build
        weights, room = 0, int(args.room_gib * (1 << 30))
    print(
        f"{args.layers}-layer bench model: weights {weights / 2**30:.1f} GiB, cache room "
        f"{room / 2**30:.1f} GiB, blocks of {args.block_tokens} tokens, "
        f"max running {args.max_running}"
    )
    head = ("context length", "request tokens", "total tokens", "before (slots)", "after (blocks)")
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        raw_ctx = {**raw, "max_position_embeddings": max(ctx, raw["max_position_embeddings"])}
        shape = CacheShape.from_model_config(DeepseekV4ModelConfig.from_dict(raw_ctx), 2)
        total = max_total_tokens_for_memory(
            shape,
            room_bytes=room,
            max_running_requests=args.max_running,
            chunked_prefill_size=args.chunk,
            context_length=ctx,
            max_logit_rows=logit_rows,
        )
        before = slot_concurrency(total, ctx, args.max_running)
        for req in (int(r) for r in args.request_tokens.split(",")):
            if req > ctx:
                continue
            after = block_concurrency(total, req, args.block_tokens, args.max_running)
            rows.append((ctx, req, total, before, after))
    print(markdown_table(head, rows))


if __name__ == "__main__":
    main()
