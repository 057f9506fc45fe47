"""Multi-GPU benchmarks of expert parallelism and DP attention (they need 2+ GPUs of one host).

``layer``: one FusedMoE layer (bf16, triton runner, DeepSeek V4-like expert shape: 256 experts
top-6, hidden 4096, intermediate 2048) on N GPUs over NCCL, ``--moe-a2a-backend none`` (experts
TP-sliced, one all-reduce) against ``ep`` (whole experts a rank, all-to-all dispatch and combine
plus an all-gather of the rows) and, with ``--ep-size E < N``, ``ep`` with E expert-parallel
ranks (each expert TP-sliced over N / E of them, their partial sums all-reduced), eager, median
of timed forwards after a warm-up. Prints a table: microseconds a layer for each, the ratio to
``none``, and the all-to-all bytes each rank sends a way.

``serving``: the serving benchmark of ``bench_serving_h200.py`` (same random DeepSeek
V4-architecture model and workload), two servers that differ in one feature:
  ep       --tp-size N --ep-size N                      vs --tp-size N
  ep-sliced --tp-size N --ep-size E (E < N, --ep-size)  vs --tp-size N --ep-size N
  dp-symm  --tp-size N --dp-size N --enable-dp-attention --enable-symm-mem
                                                        vs the same without --enable-symm-mem
  dp-ep    --tp-size N --dp-size N --enable-dp-attention --ep-size N
                                                        vs the same without --ep-size
  megamoe  --tp-size N --dp-size N --enable-dp-attention --moe-a2a-backend megamoe
           (DeepGEMM's multi-rank MegaMoE)              vs the same with --ep-size N instead

``commands``: print the ready-to-run lines for an 8-GPU H200 host.

Usage: python scripts/bench_ep.py layer [--world-size 8] [--ep-size 2] [--tokens 1,8,64,512]
       python scripts/bench_ep.py serving --compare ep|ep-sliced|dp-symm|dp-ep|megamoe
           [--tp-size 8] [--ep-size 2] [--concurrency 1,8,64] [--layers 3]
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

from sglang.bench_table import markdown_table
from sglang.test.multiprocess import run_distributed

TOKENS = (1, 8, 64, 512, 4096)
EXPERTS, TOP_K, HIDDEN, INTER = 256, 6, 4096, 2048


def _layouts(world: int, ep_size: int | None) -> dict[str, tuple[str, int | None]]:
    """label -> (a2a backend, ep size) for ``layer``."""
    out: dict[str, tuple[str, int | None]] = {"none": ("none", None), "ep": ("ep", world)}
    if ep_size is not None and ep_size < world:
        out[f"ep{ep_size}"] = ("ep", ep_size)
    return out


def _layer_times(
    rank: int, world: int, tokens: list[int], iters: int, ep_size: int | None
) -> dict[str, list[float]]:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.moe.expert_weights import ExpertWeights
    from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
    from sglang.srt.layers.moe.topk import TopKConfig, select_experts

    ps.initialize_model_parallel(world)
    device = torch.device("cuda", rank)
    out: dict[str, list[float]] = {}
    for label, (a2a, ep) in _layouts(world, ep_size).items():
        config = FusedMoEConfig(
            EXPERTS, HIDDEN, INTER, TOP_K, runner="triton", a2a_backend=a2a, ep_size=ep
        )
        layer = FusedMoE(
            config,
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
        out[label] = times
        del layer
        torch.cuda.empty_cache()
    ps.destroy_model_parallel()
    return out


def bench_layer(world: int, tokens: list[int], iters: int, ep_size: int | None) -> None:
    if torch.cuda.device_count() < world:
        sys.exit(
            f"layer: --world-size {world} needs {world} GPUs, {torch.cuda.device_count()} seen"
        )
    if ep_size is not None and (ep_size < 1 or world % ep_size or EXPERTS % ep_size):
        sys.exit(f"layer: --ep-size {ep_size} must divide --world-size {world} and {EXPERTS}")
    layouts = _layouts(world, ep_size)
    ranks = run_distributed(
        _layer_times, world, tokens, iters, ep_size, backend="nccl", timeout_s=1800
    )
    # The slowest rank sets the layer's time.
    us = {k: [max(r[k][j] for r in ranks) for j in range(len(tokens))] for k in layouts}
    print(
        f"\nFusedMoE layer, {EXPERTS} experts top-{TOP_K}, hidden {HIDDEN}, intermediate {INTER}, "
        f"bf16, triton runner, {world} GPUs (NCCL), eager, median of {iters}"
    )
    eps = [k for k in layouts if k != "none"]
    head = ["tokens", "none us", *(f"{k} us" for k in eps), *(f"{k}/none" for k in eps)]
    head += [f"{k} a2a MiB sent a way per rank" for k in eps]
    rows = []
    for j, t in enumerate(tokens):
        none = us["none"][j]
        cells = [str(t), f"{none:.0f}", *(f"{us[k][j]:.0f}" for k in eps)]
        cells += [f"{us[k][j] / none:.3f}" for k in eps]
        # Each rank sends the slots of rows / E rows (E = the layout's ep size).
        cells += [f"{(t / layouts[k][1]) * TOP_K * HIDDEN * 2 / (1 << 20):.2f}" for k in eps]
        rows.append(cells)
    print(markdown_table(head, rows))


def _serving_comparisons(
    n: int, ep_size: int
) -> dict[str, tuple[tuple[str, ...], tuple[str, ...], str]]:
    """name -> (on flags, off flags, label pair) for ``serving``."""
    dp = ("--dp-size", str(n), "--enable-dp-attention")
    ep = ("--ep-size", str(n))
    return {
        "ep": (ep, (), "ep/tp"),
        "ep-sliced": (("--ep-size", str(ep_size)), ep, f"ep{ep_size}/ep{n}"),
        "dp-symm": ((*dp, "--enable-symm-mem"), dp, "symm-mem/regular"),
        "dp-ep": ((*dp, *ep), dp, "ep/tp"),
        "megamoe": ((*dp, "--moe-a2a-backend", "megamoe"), (*dp, *ep), "megamoe/ep"),
    }


def bench_serving(args: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_serving_h200 import Comparison, build_model, print_table, serve_and_bench

    if torch.cuda.device_count() < args.tp_size:
        sys.exit(f"serving: --tp-size {args.tp_size} needs as many GPUs")
    ep_size = args.ep_size if args.ep_size is not None else max(1, args.tp_size // 2)
    on_args, off_args, labels = _serving_comparisons(args.tp_size, ep_size)[args.compare]
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
# E < T: EP=2 and EP=4 over 8 GPUs (each expert TP-sliced over 4 / 2 ranks) beside none and EP=8:
python scripts/bench_ep.py layer --world-size 8 --ep-size 2 --tokens 1,8,64,512,4096,16384
python scripts/bench_ep.py layer --world-size 8 --ep-size 4 --tokens 1,8,64,512,4096,16384
python scripts/bench_ep.py layer --world-size 4 --ep-size 2
# Serving, 8 GPUs: EP under TP attention; DP attention with and without symmetric memory;
# EP under DP attention; DeepGEMM's multi-rank MegaMoE against our all-to-all EP:
python scripts/bench_ep.py serving --compare ep --tp-size 8 --concurrency 1,8,64
python scripts/bench_ep.py serving --compare ep-sliced --tp-size 8 --ep-size 2 --concurrency 1,8,64
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
    layer.add_argument("--ep-size", type=int, default=None, help="also ep with E < world")
    serving = sub.add_parser("serving", help="two servers, one feature on and off")
    serving.add_argument(
        "--compare", choices=("ep", "ep-sliced", "dp-symm", "dp-ep", "megamoe"), default="ep"
    )
    serving.add_argument("--tp-size", type=int, default=8)
    serving.add_argument("--ep-size", type=int, default=None, help="ep-sliced: E (tp/2)")
    serving.add_argument("--concurrency", default="1,8,64")
    serving.add_argument("--layers", type=int, default=3)
    serving.add_argument("--model-dir", default="/tmp/sglang-bench-dsv4-h200")
    serving.add_argument("--keep-model", action="store_true")
    serving.add_argument("--port", type=int, default=30111)
    serving.add_argument("--log-dir", default=os.environ.get("OUT", "/tmp"))
    sub.add_parser("commands", help="print the ready-to-run lines")
    args = parser.parse_args()
    if args.mode == "layer":
        tokens = [int(t) for t in args.tokens.split(",")]
        bench_layer(args.world_size, tokens, args.iters, args.ep_size)
    elif args.mode == "serving":
        bench_serving(args)
    else:
        print(COMMANDS, end="")


if __name__ == "__main__":
    main()
