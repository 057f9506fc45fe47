"""Multi-GPU benchmarks of expert parallelism and DP attention (they need 2+ GPUs of one host).

``layer``: one FusedMoE layer (bf16, triton runner, DeepSeek V4-like expert shape: 256 experts
top-6, hidden 4096, intermediate 2048) on N GPUs over NCCL, ``--moe-a2a-backend none`` (experts
TP-sliced, one all-reduce) against ``ep`` (whole experts a rank, all-to-all dispatch and combine
plus an all-gather of the rows), eager, median of timed forwards after a warm-up. Prints a table:
microseconds a layer for each backend, ep/none, and the all-to-all bytes each rank sends a way.

``serving``: the serving benchmark of ``bench_serving_h200.py`` (same random DeepSeek
V4-architecture model and workload), two servers that differ in one feature:
  ep       --tp-size N --ep-size N                      vs --tp-size N
  dp-symm  --tp-size N --dp-size N --enable-dp-attention --enable-symm-mem
                                                        vs the same without --enable-symm-mem
  dp-ep    --tp-size N --dp-size N --enable-dp-attention --ep-size N
                                                        vs the same without --ep-size
  megamoe  --tp-size N --dp-size N --enable-dp-attention --moe-a2a-backend megamoe
           (DeepGEMM's multi-rank MegaMoE)              vs the same with --ep-size N instead

``commands``: print the ready-to-run lines for an 8-GPU H200 host.

Usage: python scripts/bench_ep.py layer [--world-size 8] [--tokens 1,8,64,512,4096]
       python scripts/bench_ep.py serving --compare ep|dp-symm|dp-ep|megamoe [--tp-size 8]
           [--concurrency 1,8,64] [--layers 3]
       python scripts/bench_ep.py commands
Run from the repository root (``scripts/`` on the path for bench_serving_h200).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from sglang.test.multiprocess import run_distributed

TOKENS = (1, 8, 64, 512, 4096)
EXPERTS, TOP_K, HIDDEN, INTER = 256, 6, 4096, 2048


def _layer_times(rank: int, world: int, tokens: list[int], iters: int) -> dict[str, list[float]]:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.moe.expert_weights import ExpertWeights
    from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
    from sglang.srt.layers.moe.topk import TopKConfig, select_experts

    ps.initialize_model_parallel(world)
    device = torch.device("cuda", rank)
    out: dict[str, list[float]] = {}
    for a2a in ("none", "ep"):
        layer = FusedMoE(
            FusedMoEConfig(EXPERTS, HIDDEN, INTER, TOP_K, runner="triton", a2a_backend=a2a),
            tp_rank=rank,
            tp_size=world,
            device=device,
        )
        g = torch.Generator(device=device).manual_seed(0)
        e, i = len(layer.local_experts), len(layer.local_intermediate)
        w13 = torch.randn(e, 2 * i, HIDDEN, generator=g, device=device, dtype=torch.bfloat16)
        w2 = torch.randn(e, HIDDEN, i, generator=g, device=device, dtype=torch.bfloat16)
        layer.load_local_weights(ExpertWeights(w13 * HIDDEN**-0.5, w2 * i**-0.5))
        del w13, w2
        times = []
        for t in tokens:
            gen = torch.Generator(device=device).manual_seed(t)  # same rows on every rank
            x = torch.randn(t, HIDDEN, generator=gen, device=device, dtype=torch.bfloat16)
            logits = torch.randn(t, EXPERTS, generator=gen, device=device)
            topk = select_experts(logits, TopKConfig(TOP_K, "sqrtsoftplus"))
            for _ in range(3):
                layer(x, topk)
            samples = []
            for _ in range(iters):
                ps.get_tp_group().barrier()
                torch.cuda.synchronize()
                begin = time.perf_counter()
                layer(x, topk)
                torch.cuda.synchronize()
                samples.append((time.perf_counter() - begin) * 1e6)
            times.append(statistics.median(samples))
        out[a2a] = times
        del layer
        torch.cuda.empty_cache()
    ps.destroy_model_parallel()
    return out


def bench_layer(world: int, tokens: list[int], iters: int) -> None:
    if torch.cuda.device_count() < world:
        sys.exit(
            f"layer: --world-size {world} needs {world} GPUs, {torch.cuda.device_count()} seen"
        )
    ranks = run_distributed(_layer_times, world, tokens, iters, backend="nccl", timeout_s=1800)
    # The slowest rank sets the layer's time.
    none = [max(r["none"][j] for r in ranks) for j in range(len(tokens))]
    ep = [max(r["ep"][j] for r in ranks) for j in range(len(tokens))]
    print(
        f"\nFusedMoE layer, {EXPERTS} experts top-{TOP_K}, hidden {HIDDEN}, intermediate {INTER}, "
        f"bf16, triton runner, {world} GPUs (NCCL), eager, median of {iters}"
    )
    print("| tokens | none us | ep us | ep/none | a2a MiB sent a way per rank |")
    print("|-------:|--------:|------:|--------:|----------------------------:|")
    for t, a, b in zip(tokens, none, ep, strict=True):
        mib = (t / world) * TOP_K * HIDDEN * 2 / (1 << 20)
        print(f"| {t:>6} | {a:>7.0f} | {b:>5.0f} | {b / a:>7.3f} | {mib:>27.2f} |")


def _serving_comparisons(n: int) -> dict[str, tuple[tuple[str, ...], tuple[str, ...], str]]:
    """name -> (on flags, off flags, label pair) for ``serving``."""
    dp = ("--dp-size", str(n), "--enable-dp-attention")
    ep = ("--ep-size", str(n))
    return {
        "ep": (ep, (), "ep/tp"),
        "dp-symm": ((*dp, "--enable-symm-mem"), dp, "symm-mem/regular"),
        "dp-ep": ((*dp, *ep), dp, "ep/tp"),
        "megamoe": ((*dp, "--moe-a2a-backend", "megamoe"), (*dp, *ep), "megamoe/ep"),
    }


def bench_serving(args: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_serving_h200 import Comparison, build_model, print_table, serve_and_bench

    if torch.cuda.device_count() < args.tp_size:
        sys.exit(f"serving: --tp-size {args.tp_size} needs as many GPUs")
    on_args, off_args, labels = _serving_comparisons(args.tp_size)[args.compare]
    on_label, off_label = labels.split("/")
    cmp = Comparison("a2a:", on_label, off_label, on_args, off_args)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    tp = ["--tp-size", str(args.tp_size)]
    model_dir = Path(args.model_dir)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    build_model(model_dir, args.layers)
    torch.cuda.empty_cache()
    try:
        runs = [
            serve_and_bench(
                model_dir,
                args.port,
                [*tp, *extra],
                cmp.fact,
                label,
                concurrency,
                log_dir / f"bench_ep_{args.compare}_{label}.log",
            )
            for label, extra in ((on_label, on_args), (off_label, off_args))
        ]
    finally:
        if not args.keep_model:
            shutil.rmtree(model_dir, ignore_errors=True)
    print(f"\n{args.compare}: {' '.join(on_args)} vs {' '.join(off_args) or 'TP only'}")
    print_table(cmp, runs[0], runs[1], concurrency, args.tp_size)
    print(f"\ntotal {time.perf_counter() - started:.0f}s")


COMMANDS = """\
# NCCL all-to-all EP against TP-sliced experts, one MoE layer, 2 / 4 / 8 GPUs:
python scripts/bench_ep.py layer --world-size 2
python scripts/bench_ep.py layer --world-size 8 --tokens 1,8,64,512,4096,16384
# Serving, 8 GPUs: EP under TP attention; DP attention with and without symmetric memory;
# EP under DP attention; DeepGEMM's multi-rank MegaMoE against our all-to-all EP:
python scripts/bench_ep.py serving --compare ep --tp-size 8 --concurrency 1,8,64
python scripts/bench_ep.py serving --compare dp-symm --tp-size 8 --concurrency 8,64,256
python scripts/bench_ep.py serving --compare dp-ep --tp-size 8 --concurrency 8,64,256
python scripts/bench_ep.py serving --compare megamoe --tp-size 8 --concurrency 8,64,256
# One GPU (D = E = 1 keeps today's path): the existing serving bench, for a no-slowdown check:
python scripts/bench_serving_h200.py --compare graphs --concurrency 1,8,32
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    layer = sub.add_parser("layer", help="one FusedMoE layer: none vs ep over NCCL")
    layer.add_argument("--world-size", type=int, default=8)
    layer.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    layer.add_argument("--iters", type=int, default=20)
    serving = sub.add_parser("serving", help="two servers, one feature on and off")
    serving.add_argument("--compare", choices=("ep", "dp-symm", "dp-ep", "megamoe"), default="ep")
    serving.add_argument("--tp-size", type=int, default=8)
    serving.add_argument("--concurrency", default="1,8,64")
    serving.add_argument("--layers", type=int, default=3)
    serving.add_argument("--model-dir", default="/tmp/sglang-bench-dsv4-h200")
    serving.add_argument("--keep-model", action="store_true")
    serving.add_argument("--port", type=int, default=30111)
    serving.add_argument("--log-dir", default=os.environ.get("OUT", "/tmp"))
    sub.add_parser("commands", help="print the ready-to-run lines")
    args = parser.parse_args()
    if args.mode == "layer":
        bench_layer(args.world_size, [int(t) for t in args.tokens.split(",")], args.iters)
    elif args.mode == "serving":
        bench_serving(args)
    else:
        print(COMMANDS, end="")


if __name__ == "__main__":
    main()
