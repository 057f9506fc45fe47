"""Probe the MXFP4 W4A16 fused MoE's decode candidates on one GPU and write the winners as the
tuned table ``mxfp4_config.py`` reads.

For each shape (``--shapes``: DeepSeek V4 experts at M 1, 4, 16, 64; Kimi K3 latent experts at M
1 and 16) and each candidate (the default rule, the dot-order kernel's former decode tiles, the
split kernel at a few tile sizes and pipeline depths; at most a dozen):
1. one eager call on fresh random experts and routing, checked against the torch oracle
   (``fused_experts_mxfp4_weights_torch``: each expert dequantised exactly, fp32 GEMMs);
   a relative error of ``--tol`` (2e-2) or more, or a non-finite output, marks it wrong;
2. the time of one call under CUDA-graph replay: ``--rotate`` calls on different inputs and
   routings (so consecutive calls touch different experts and L2 does not serve the weights)
   captured in one graph, the median of ``--reps`` timed replays over ``--rotate``; the replayed
   result must equal the eager call's.
A candidate that does not fit, fails to compile or run, or is wrong is reported in the table and
skipped; it never stops the probe. Prints one table (candidate x M: us and the share of a
device-to-device copy's bandwidth reached on the 4-bit bytes of the experts touched, as in
``bench_moe_mxfp4.py``), then writes the fastest correct candidate of each M as that M's bucket
into ``{E}_..._mxfp4_{device}.json`` under ``--out-dir`` (default ``$OUT``, else
``./mxfp4_probe_out``); past the largest M probed the table repeats the default rule's configs at
the batch sizes where the rule changes, so prefill is untouched. Copy the file into
``python/sglang/kernels/ops/moe/configs/`` to use it.

The split kernel's row counts are not specialised on, so each candidate compiles its two GEMMs
once for every M (GEMM 1 once more for Kimi K3's activation): about 60 compiles in all. The probe
prints how many kernels it compiled and how long it ran. ``--budget-s`` (default 120) skips what
is left (reported as such) once it is spent.

Usage: python scripts/mxfp4_decode_probe.py [--shapes dsv4,k3] [--batches 1,4,16,64]
       [--k3-batches 1,16] [--rotate 8] [--reps 20] [--out-dir DIR] [--candidates name,...]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe_mxfp4 import Batch, Shape, copy_bandwidth, expert_bytes, shapes
from moe_bench_common import table_path, write_tuned_table
from sglang.kernels.ops.moe import align, fused_moe, fused_moe_mxfp4, mxfp4_split_gemm
from sglang.kernels.ops.moe.fused_moe_mxfp4 import (
    fused_experts_mxfp4_weights,
    fused_experts_mxfp4_weights_torch,
)
from sglang.kernels.ops.moe.mxfp4_config import (
    DOT_ORDER,
    DTYPE_KEY,
    SPLIT,
    Mxfp4GemmTile,
    Mxfp4MoeConfig,
    config_to_dict,
    default_mxfp4_config,
    mxfp4_config_fits,
)
from sglang.kernels.ops.moe.mxfp4_weights import Mxfp4MoeWeights, prepare_mxfp4_moe_weights
from sglang.test.mxfp4_experts import random_mxfp4_experts, random_routing
from sglang.test.tolerance import rel_norm_err

T = Mxfp4GemmTile


def _split(g1: T, g2: T, x_in_order: bool = False) -> Mxfp4MoeConfig:
    return Mxfp4MoeConfig(16, g1, g2, x_in_dot_order=x_in_order, kernel=SPLIT)


# name -> config (None: the default rule at each M). Split tiles are named by their weight rows
# (GEMM 1: 2 x block_n, gate and up) and stages; rows x stages is what a CTA keeps in flight,
# the rows also set how many CTAs share the SMs at batch 1.
CANDIDATES: dict[str, Mxfp4MoeConfig | None] = {
    "default rule": None,
    "dot 128r s4 (old)": Mxfp4MoeConfig(16, T(64, 1, 4, 4), T(128, 1, 4, 4), kernel=DOT_ORDER),
    "dot 64r s6": Mxfp4MoeConfig(16, T(32, 1, 4, 6), T(64, 1, 4, 6), kernel=DOT_ORDER),
    "split 64r s4": _split(T(32, 1, 4, 4), T(64, 1, 4, 4)),
    "split 64r s6": _split(T(32, 1, 4, 6), T(64, 1, 4, 6)),
    "split 64r s8": _split(T(32, 1, 4, 8), T(64, 1, 4, 8)),
    "split 64r s6 x-ord": _split(T(32, 1, 4, 6), T(64, 1, 4, 6), x_in_order=True),
    "split 32r s6 2w": _split(T(16, 1, 2, 6), T(32, 1, 2, 6)),
    "split 32r s8 2w": _split(T(16, 1, 2, 8), T(32, 1, 2, 8)),
    "split 16r s8 1w": _split(T(8, 1, 1, 8), T(16, 1, 1, 8)),
    "split 128r s4": _split(T(64, 1, 4, 4), T(128, 1, 4, 4)),
    "split 128r s4 8w": _split(T(64, 1, 8, 4), T(128, 1, 8, 4)),
}


@dataclass
class Result:
    """One (candidate, M): the time of a call, or why there is none."""

    us: float | None = None
    err: float | None = None
    why: str = ""


def kernels_compiled() -> int:
    """Kernels Triton compiled so far in this process for the MoE modules (-1 if unknown)."""
    modules: tuple[ModuleType, ...] = (align, fused_moe, fused_moe_mxfp4, mxfp4_split_gemm)
    total = 0
    try:
        for mod in modules:
            for obj in vars(mod).values():
                if isinstance(obj, triton.runtime.jit.JITFunction):
                    total += sum(len(entry[0]) for entry in obj.device_caches.values())
    except Exception:  # noqa: BLE001 -- Triton's cache layout is not an API
        return -1
    return total


def one_line(err: BaseException) -> str:
    """The error's type, first and last line (a compile error's reason is often the last)."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()] or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(err).__name__}: {text}"[:200]


class Problem:
    """One (shape, M): its routings, the oracle of the first, the experts touched per call."""

    def __init__(self, shape: Shape, weights: Mxfp4MoeWeights, m: int, rotate: int) -> None:
        self.shape, self.weights, self.m = shape, weights, m
        self.act = {"activation": shape.activation, "swiglu_limit": shape.swiglu_limit}
        self.batches: list[Batch] = [
            random_routing(m, shape.hidden, shape.experts, shape.top_k, seed=7919 * m + r,
                           device="cuda")
            for r in range(rotate)
        ]  # fmt: skip
        x, tw, ids = self.batches[0]
        self.want = fused_experts_mxfp4_weights_torch(x, weights, tw, ids, **self.act)  # type: ignore[arg-type]
        self.touched = statistics.mean(int(torch.unique(b[2]).numel()) for b in self.batches)

    def call(self, cfg: Mxfp4MoeConfig, batch: Batch, out: torch.Tensor) -> None:
        x, tw, ids = batch
        fused_experts_mxfp4_weights(x, self.weights, tw, ids, out=out, config=cfg, **self.act)  # type: ignore[arg-type]

    def run(self, cfg: Mxfp4MoeConfig, tol: float, reps: int) -> Result:
        why = mxfp4_config_fits(cfg, self.shape.hidden, self.shape.inter)
        if why:
            return Result(why=f"no fit: {why}")
        outs = [torch.empty_like(b[0]) for b in self.batches]
        try:
            self.call(cfg, self.batches[0], outs[0])
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 -- a candidate that fails is reported, skipped
            return Result(why=f"failed: {one_line(err)}")
        err = rel_norm_err(outs[0], self.want)
        if not torch.isfinite(outs[0]).all() or not err < tol:
            return Result(err=err, why=f"WRONG: rel err {err:.2e}")
        eager = outs[0].clone()
        try:
            us = self.graph_us(cfg, outs, reps)
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()
            return Result(err=err, why=f"graph failed: {one_line(e)}")
        if not torch.equal(outs[0], eager):
            return Result(err=err, why="WRONG: graph replay differs from the eager call")
        return Result(us=us, err=err)

    def graph_us(self, cfg: Mxfp4MoeConfig, outs: list[torch.Tensor], reps: int) -> float:
        """Median time of one call over ``reps`` replays of a graph of ``--rotate`` calls."""
        for batch, out in zip(self.batches, outs, strict=True):  # warm every routing
            self.call(cfg, batch, out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for batch, out in zip(self.batches, outs, strict=True):
                self.call(cfg, batch, out)
        graph.replay()
        graph.replay()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(self.batches))
        del graph
        return statistics.median(times)


def rule_buckets(shape: Shape, above: int) -> list[dict[str, object]]:
    """Buckets past ``above`` (the largest M probed, whose winner holds until the default rule
    changes) that reproduce the default rule: one at each M where it changes."""
    buckets: list[dict[str, object]] = []
    last = default_mxfp4_config(above, shape.experts, shape.top_k)
    for m in range(above + 1, 1 << 17):
        cfg = default_mxfp4_config(m, shape.experts, shape.top_k)
        if cfg != last:
            buckets.append({"m": m, "source": "default rule", "config": config_to_dict(cfg)})
            last = cfg
    return buckets


# M -> (experts touched per call, candidate -> result)
ShapeResults = dict[int, tuple[float, dict[str, Result]]]


def probe_shape(shape: Shape, ms: list[int], args: argparse.Namespace, deadline: float,
                names: list[str]) -> ShapeResults:  # fmt: skip
    weights = prepare_mxfp4_moe_weights(
        *random_mxfp4_experts(shape.experts, shape.hidden, shape.inter, seed=0, device="cuda")
    )
    results: ShapeResults = {}
    for m in ms:
        problem = Problem(shape, weights, m, args.rotate)
        per_name: dict[str, Result] = {}
        results[m] = (problem.touched, per_name)
        for name in names:
            cfg = CANDIDATES[name] or default_mxfp4_config(m, shape.experts, shape.top_k)
            if time.monotonic() > deadline:
                per_name[name] = Result(why="skipped: --budget-s spent")
                continue
            t0 = time.monotonic()
            res = problem.run(cfg, args.tol, args.reps)
            per_name[name] = res
            took = time.monotonic() - t0
            state = f"{res.us:.1f} us" if res.us is not None else res.why
            compiled = kernels_compiled()
            print(f"  {shape.name[:14]} M={m} {name}: {state} ({took:.1f} s, {compiled} kernels "
                  "compiled so far)", flush=True)  # fmt: skip
        del problem
        torch.cuda.empty_cache()
    del weights
    torch.cuda.empty_cache()
    return results


def print_table(shape: Shape, results: ShapeResults, copy_bw: float, names: list[str]) -> None:
    ms = list(results)
    print(f"\n{shape.name}: us per call (share of the {copy_bw / 1e9:.0f} GB/s copy bandwidth on "
          "the MXFP4 bytes of the experts touched); * = the fastest correct")  # fmt: skip
    touched = " | ".join(f"{results[m][0]:.0f}" for m in ms)
    print("| candidate | " + " | ".join(f"M={m}" for m in ms) + " |")
    print("|---|" + "---:|" * len(ms))
    print(f"| experts touched | {touched} |")
    best = {m: winner(results[m][1]) for m in ms}
    for name in names:
        cells = []
        for m in ms:
            touched_m, res = results[m]
            r = res[name]
            if r.us is None:
                cells.append(r.why[:60])
                continue
            share = touched_m * expert_bytes(shape) / (r.us * 1e-6) / copy_bw
            star = "*" if best[m] == name else ""
            cells.append(f"{star}{r.us:.1f} ({share:.0%})")
        print(f"| {name} | " + " | ".join(cells) + " |")


def winner(res: dict[str, Result]) -> str | None:
    timed = [(r.us, n) for n, r in res.items() if r.us is not None]
    return min(timed)[1] if timed else None


def write_table(shape: Shape, results: ShapeResults, out_dir: Path) -> Path | None:
    device = torch.cuda.get_device_name()
    buckets: list[dict[str, object]] = []
    for m, (_, res) in results.items():
        name = winner(res)
        if name is None:
            print(f"  M={m}: no correct candidate; no bucket written")
            continue
        cfg = CANDIDATES[name] or default_mxfp4_config(m, shape.experts, shape.top_k)
        rule = res.get("default rule")
        buckets.append({
            "m": m, "us": round(res[name].us or math.nan, 1), "candidate": name,
            "default_us": round(rule.us, 1) if rule and rule.us else None,
            "config": config_to_dict(cfg),
        })  # fmt: skip
    if not buckets:
        return None
    buckets += rule_buckets(shape, max(results))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = table_path(out_dir, shape, DTYPE_KEY, device)
    write_tuned_table(
        path, device, shape, DTYPE_KEY, buckets, source="scripts/mxfp4_decode_probe.py"
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="dsv4,k3")
    parser.add_argument("--batches", default="1,4,16,64", help="M values of DeepSeek V4")
    parser.add_argument("--k3-batches", default="1,16", help="M values of Kimi K3")
    parser.add_argument("--k3-experts", type=int, default=384)
    parser.add_argument("--rotate", type=int, default=8, help="routings per graph")
    parser.add_argument("--reps", type=int, default=20, help="timed graph replays")
    parser.add_argument("--tol", type=float, default=2e-2, help="relative error against the oracle")
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--candidates", default="", help="names to keep (default: all)")
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or "mxfp4_probe_out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mxfp4_decode_probe.py needs a CUDA GPU")
    names = list(CANDIDATES)
    if args.candidates:
        names = [n.strip() for n in args.candidates.split(",")]
        unknown = [n for n in names if n not in CANDIDATES]
        if unknown:
            raise SystemExit(f"unknown --candidates {unknown}; known: {list(CANDIDATES)}")
    known = shapes(args.k3_experts)
    keys = [k.strip() for k in args.shapes.split(",")]
    if any(k not in known for k in keys):
        raise SystemExit(f"--shapes must name some of {list(known)}, got {args.shapes!r}")
    start = time.monotonic()
    deadline = start + args.budget_s
    copy_bw = copy_bandwidth(1 << 30)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; {len(names)} candidates", flush=True)
    done = []
    for key in keys:
        batches = args.batches if key == "dsv4" else args.k3_batches
        ms = [int(b) for b in batches.split(",")]
        shape = known[key]
        done.append((key, shape, probe_shape(shape, ms, args, deadline, names)))
    for _, shape, results in done:
        print_table(shape, results, copy_bw, names)
    out_dir = Path(args.out_dir)
    for _, shape, results in done:
        path = write_table(shape, results, out_dir)
        if path:
            print(f"wrote {path}")
    print(f"\n{kernels_compiled()} kernels compiled; {time.monotonic() - start:.0f} s in all")


if __name__ == "__main__":
    main()
