"""Serving benchmark on H200s: a DeepSeek V4-architecture model wide enough to matter, served twice
by ``launch_server`` with one feature on and off, loaded by our ``bench_serving``.

``--compare graphs`` (default): with and without decode CUDA graphs. ``--compare symm-mem
--tp-size N``: with and without ``--enable-symm-mem`` at TP=N (both with graphs), e.g.
``--compare symm-mem --tp-size 8 --concurrency 1,8,64``. ``--compare baseline --baseline DIR``:
this tree against another checkout of the repo at ``DIR`` (its ``python/`` first on the second
server's PYTHONPATH), same flags, both with graphs: a slowdown check in one run.

Model (random weights written on the GPU into ``--model-dir`` on first use by the test kit's
release writer): hidden 4096, 256 routed experts top-6 (intermediate 2048) + one shared expert, 64
heads of 512 (q rank 1024, 8 output groups of rank 1024), window 128, layers of compress ratios
4 / 128 / 4 (indexer 64 heads of 128, top-512), the first layer hash-routed, vocab 4096 (no
tokenizer: the benchmark sends token ids). ``--weights bf16``: every tensor bf16 (~13 GB a
layer); ``--weights release``: the layout DeepSeek publishes, FP8 dense weights with UE8M0
128x128 scales, MXFP4 experts, an MTP layer (~3.5 GB a layer). Workload: fixed 256 input and
128 output tokens, greedy, 2x the concurrency in prompts (at least 4), after an untimed warm-up
as wide as the run.

Prints one table: TTFT and TPOT (median ms), output and total throughput (tok/s) for both servers,
then on/off ratios (TPOT < 1 and throughput > 1 mean the feature helps). Each server's log goes
to ``--log-dir``; this tree's servers write an activity line a second there (the steps by kind,
decode / mixed / prefill, with their mean time: where a TTFT or TPOT goes).
Usage: python scripts/bench_serving_h200.py [--compare graphs|symm-mem|weights|megamoe]
       [--tp-size N] [--concurrency 1,8,32] [--layers 3] [--weights bf16|release]
       [--model-dir DIR] [--keep-model]
About 2.5 minutes on one H200 with --layers 2 (generation 30 s, two server starts, six runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sglang.bench_server import launched_server
from sglang.bench_serving import build_parser, run_benchmark
from sglang.test.release_checkpoint import deepseek_v4 as release
from sglang.test.wide_dsv4 import wide_dsv4_config

CONCURRENCY = (1, 8, 32)
INPUT_LEN, OUTPUT_LEN = 256, 128


def model_config(layers: int, max_positions: int = 4096) -> dict[str, Any]:
    ratios = [(4, 128)[i % 2] for i in range(layers)]
    return wide_dsv4_config(ratios, num_hash_layers=1, max_positions=max_positions)


# --weights: how the bench model's checkpoint is written (the release kit's writer either way).
WEIGHTS: dict[str, dict[str, Any]] = {
    # every tensor bf16, no MTP layer: the engine's resident format without conversions
    "bf16": {"dense": "bf16", "experts": "bf16", "mtp": False},
    # as DeepSeek releases it: FP8 128x128 dense weights (UE8M0 scales), MXFP4 experts, an MTP
    # layer (skipped at load), sharded with an index
    "release": {"dense": "fp8", "experts": "mxfp4", "mtp": True},
}


def add_bench_model_args(parser: argparse.ArgumentParser, layers: int) -> None:
    """The flags of the generated bench model (``--layers``, where it is written and whether it
    is kept) and of where its servers log."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--model-dir", default="/tmp/sglang-bench-dsv4-h200")
    parser.add_argument("--keep-model", action="store_true", help="Keep the generated weights.")
    parser.add_argument("--log-dir", default=os.environ.get("OUT", "/tmp"))


def build_model(
    directory: Path, layers: int, weights: str = "bf16", max_positions: int = 4096
) -> None:
    config = model_config(layers, max_positions)
    fmt = WEIGHTS[weights]
    want = release.release_config(config, dense=fmt["dense"], mtp=fmt["mtp"])
    if (directory / "READY").exists():
        same = (directory / "READY").read_text().strip() == weights
        if same and json.loads((directory / "config.json").read_text()) == want:
            print(f"model: reusing {directory}")
            return
    if directory.exists():  # another model, or a write that did not finish
        shutil.rmtree(directory)
    started = time.perf_counter()
    # Drawn and quantised on the GPU (CPU draws of ~40 GB would take most of the time budget).
    ckpt = release.write_random(directory, config, device="cuda", keep_values=False, **fmt)
    (directory / "READY").write_text(f"{weights}\n")
    print(
        f"model: wrote {layers} layers ({weights} weights, "
        f"{ckpt.layout.total_bytes() / 1e9:.1f} GB) in {directory} "
        f"({time.perf_counter() - started:.0f}s)"
    )
    print(ckpt.layout.format_table())


@dataclass(frozen=True)
class Comparison:
    """Two servers that differ in one feature: its flag on (``on_args``) or off."""

    fact: str  # the startup line's key for the feature
    on_label: str
    off_label: str
    on_args: tuple[str, ...]
    off_args: tuple[str, ...]
    # The checkpoint each server loads (a --weights name); None: the one --weights names.
    on_weights: str | None = None
    off_weights: str | None = None


COMPARISONS = {
    "graphs": Comparison("CUDA graphs:", "graphs", "eager", (), ("--disable-cuda-graph",)),
    "symm-mem": Comparison("symmetric memory:", "symm-mem", "regular", ("--enable-symm-mem",), ()),
    "baseline": Comparison("CUDA graphs:", "this tree", "baseline", (), ()),
    # the model as DeepSeek ships it (FP8 dense, MXFP4 experts kept so) against all-bf16 weights
    "weights": Comparison("CUDA graphs:", "release", "bf16", (), (), "release", "bf16"),
    # DeepGEMM's fused MegaMoE kernel (under the reserved-SM window) against the runner path
    "megamoe": Comparison("MoE runner:", "megamoe", "runner", ("--moe-a2a-backend", "megamoe"), ()),
}


def serve_and_bench(
    model_dir: Path,
    port: int,
    extra: list[str],
    fact: str,
    label: str,
    concurrency: list[int],
    log: Path,
    python_dir: Path | None = None,
) -> dict[int, Any]:
    """Start one server (its package from ``python_dir`` when given), bench every concurrency."""
    top = max(concurrency)
    env = dict(os.environ)
    if python_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(python_dir), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_dir),
        "--skip-tokenizer-init",
        "--port",
        str(port),
        "--context-length",
        "1024",
        "--max-running-requests",
        str(top),
        "--cuda-graph-max-bs",
        str(top),
        "--log-level",
        "info",
        *extra,
    ]
    if python_dir is None:  # this tree: an activity line a second in the log (steps by kind)
        cmd += ["--log-stats-interval", "1"]
    with launched_server(cmd, port, log, fact=fact, label=label, env=env):
        results = {}
        for conc in concurrency:
            args = build_parser().parse_args(
                [
                    "--port",
                    str(port),
                    "--dataset-name",
                    "fixed",
                    "--num-prompts",
                    str(max(4, 2 * conc)),
                    "--random-input-len",
                    str(INPUT_LEN),
                    "--random-output-len",
                    str(OUTPUT_LEN),
                    # Warm-up as wide as the run: the first batch of this size compiles its Triton
                    # kernels (prefill shapes differ per concurrency), which must not be timed.
                    "--max-concurrency",
                    str(conc),
                    "--warmup-requests",
                    str(conc),
                ]
            )
            results[conc] = run_benchmark(args)
            m = results[conc]
            print(
                f"  concurrency {conc}: {m['completed']} ok, {m['failed']} failed, "
                f"{m['duration_s']:.1f}s"
            )
        return results


def print_table(
    cmp: Comparison,
    on: dict[int, Any],
    off: dict[int, Any],
    concurrency: list[int],
    tp_size: int,
    weights: str,
) -> None:
    def row(label: str, m: dict[str, Any]) -> str:
        return (
            f"| {label:<16} | {m['ttft_ms']['median']:>9.1f} | {m['tpot_ms']['median']:>9.2f} "
            f"| {m['output_throughput']:>10.1f} | {m['total_throughput']:>10.1f} |"
        )

    print(
        f"\nDeepSeek V4-architecture model, {INPUT_LEN} in / {OUTPUT_LEN} out, {weights} "
        f"checkpoint, triton MoE, TP={tp_size}"
    )
    print("| mode, conc.      | TTFT ms   | TPOT ms   | out tok/s  | total tok/s |")
    print("|------------------|----------:|----------:|-----------:|------------:|")
    for conc in concurrency:
        print(row(f"{cmp.on_label}, {conc}", on[conc]))
        print(row(f"{cmp.off_label}, {conc}", off[conc]))
    pair = f"{cmp.on_label}/{cmp.off_label}"
    print(f"\n| conc. | TTFT {pair} | TPOT {pair} | throughput {pair} |")
    print("|------:|------:|------:|------:|")
    for conc in concurrency:
        a, b = on[conc], off[conc]
        ratio = [
            a["ttft_ms"]["median"] / max(b["ttft_ms"]["median"], 1e-9),
            a["tpot_ms"]["median"] / max(b["tpot_ms"]["median"], 1e-9),
            a["output_throughput"] / max(b["output_throughput"], 1e-9),
        ]
        print(f"| {conc:>5} | {ratio[0]:.3f} | {ratio[1]:.3f} | {ratio[2]:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_bench_model_args(parser, layers=3)
    parser.add_argument(
        "--compare",
        choices=tuple(COMPARISONS),
        default="graphs",
        help="graphs: with vs without decode CUDA graphs; symm-mem: with vs without "
        "--enable-symm-mem (needs --tp-size > 1); weights: the release-format checkpoint vs "
        "an all-bf16 one; megamoe: --moe-a2a-backend megamoe vs the runner path.",
    )
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument(
        "--weights",
        choices=tuple(WEIGHTS),
        default="bf16",
        help="bf16: every tensor bf16; release: the model as DeepSeek releases it (FP8 dense "
        "weights with UE8M0 block scales, MXFP4 experts, an MTP layer).",
    )
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    parser.add_argument("--port", type=int, default=30111)
    parser.add_argument("--baseline", type=Path, help="--compare baseline: the other checkout")
    args = parser.parse_args()
    if (args.compare == "baseline") != (args.baseline is not None):
        parser.error("--compare baseline and --baseline DIR go together")
    if args.baseline is not None and not (args.baseline / "python" / "sglang").is_dir():
        parser.error(f"--baseline {args.baseline}: no python/sglang package there")
    if args.compare == "symm-mem" and args.tp_size < 2:
        parser.error("--compare symm-mem needs --tp-size 2 or more (TP=1 has no all-reduce)")
    cmp = COMPARISONS[args.compare]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    tp = ["--tp-size", str(args.tp_size)]
    started = time.perf_counter()
    dirs = {}
    for weights in {cmp.on_weights or args.weights, cmp.off_weights or args.weights}:
        dirs[weights] = Path(f"{args.model_dir}-{weights}")
        build_model(dirs[weights], args.layers, weights)
    torch.cuda.empty_cache()  # the servers need the GPU
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        runs = []
        baseline_python = args.baseline / "python" if args.baseline is not None else None
        for label, extra, python_dir, weights in (
            (cmp.on_label, cmp.on_args, None, cmp.on_weights or args.weights),
            (cmp.off_label, cmp.off_args, baseline_python, cmp.off_weights or args.weights),
        ):
            log = log_dir / f"bench_server_{label.replace(' ', '_')}.log"
            runs.append(
                serve_and_bench(
                    dirs[weights],
                    args.port,
                    [*tp, *extra],
                    cmp.fact,
                    label,
                    concurrency,
                    log,
                    python_dir,
                )
            )
        on, off = runs
    finally:
        if not args.keep_model:
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)
    weights_said = args.weights if cmp.on_weights is None else "release vs bf16"
    print_table(cmp, on, off, concurrency, args.tp_size, weights_said)
    print(f"\ntotal {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
