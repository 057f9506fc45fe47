"""Where a long DeepSeek V4 prefill spends its GPU time: TTFT of one prompt and a per-module
breakdown of one layer per compression ratio, against the tensor-core rate.

The wide bench model (``sglang.test.wide_dsv4``: hidden 4096, 256 experts top-6 + shared, 64 heads
of 512, window 128, indexer 64x128 top-512) with one layer per ``--ratios`` entry, random weights.
``prefill`` is the whole forward of one ``--tokens`` prompt (embedding, layers, head: the GPU part
of TTFT), median of ``--repeats`` after a warm-up run that compiles every Triton kernel.

The breakdown puts a CUDA event before and after every module call (forward hooks) in one more
run; ``self`` is a module's time minus its children's, so the attention's ``self`` is its core
(sparse attention over window + compressed entries) and the model's ``self`` is what runs outside
any module (mHC pre/post mixing between the sublayers, the embedding gather). FLOPs are torch's
count (``FlopCounterMode``) where it knows the op; the routed MoE (a Triton kernel torch cannot
count) uses ``6 * tokens * top_k * hidden * intermediate``. ``% peak`` is against ``--peak-tflops``
(989, the H200's dense bf16 rate).

Usage: python scripts/profile_prefill.py [--tokens 8192] [--ratios 4,128] [--runner auto]
       [--json OUT.json]          (--smoke: the tiny default model on CPU, to check the script)
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from sglang.srt.default_model.config import default_model_config
from sglang.srt.default_model.generate import random_weights
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.deepseek_v4_loader import load_weights
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.test.wide_dsv4 import wide_dsv4_config

MAX_DEPTH = 4  # layers.N.attn.compressor: deeper modules are single linears, folded in their parent


@dataclass(frozen=True)
class ModuleRow:
    name: str
    calls: int
    ms: float
    self_ms: float
    gflop: float

    def line(self, total_ms: float, peak_tflops: float) -> str:
        rate = self.gflop / self.ms if self.ms > 0 else 0.0  # GFLOP/ms == TFLOP/s
        peak = f"{100 * rate / peak_tflops:>6.1f}" if self.gflop > 0 else f"{'-':>6}"
        return (
            f"{self.name:<34} {self.calls:>5} {self.ms:>9.3f} {self.self_ms:>9.3f} "
            f"{100 * self.ms / total_ms:>6.1f} {self.gflop:>9.1f} {rate:>7.1f} {peak}"
        )


class _Clock:
    """Start/stop marks on the device's timeline: CUDA events on a GPU, host time on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, begin: Any, end: Any) -> float:
        return begin.elapsed_time(end) if self.cuda else (end - begin) * 1e3


def _module_times(
    model: nn.Module, run: Callable[[], object], clock: _Clock
) -> dict[str, tuple[int, float]]:
    """name -> (calls, inclusive ms) of every module up to MAX_DEPTH, from one hooked run."""
    spans: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
    open_marks: dict[str, list[Any]] = defaultdict(list)
    handles = []
    for name, module in model.named_modules():
        if name.count(".") >= MAX_DEPTH:
            continue
        key = name or "model"

        def pre(_m: nn.Module, _a: object, key: str = key) -> None:
            open_marks[key].append(clock.mark())

        def post(_m: nn.Module, _a: object, _o: object, key: str = key) -> None:
            spans[key].append((open_marks[key].pop(), clock.mark()))

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        run()
        if clock.cuda:
            torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    return {k: (len(v), sum(clock.ms(b, e) for b, e in v)) for k, v in spans.items()}


def _module_gflop(model: nn.Module, run: Callable[[], object]) -> dict[str, float]:
    """name -> GFLOP torch counted under that module (names without the root class)."""
    counter = FlopCounterMode(display=False)
    with counter:
        run()
    out: dict[str, float] = {}
    root = type(model).__name__
    for key, per_op in counter.get_flop_counts().items():
        if key == root:
            out["model"] = sum(per_op.values()) / 1e9
        elif key.startswith(root + "."):
            out[key.removeprefix(root + ".")] = sum(per_op.values()) / 1e9
    return out


def _routed_moe_gflop(cfg: dict[str, Any], tokens: int) -> float:
    # gate-up (2 * I) and down (I) GEMMs of top_k experts per token, 2 FLOPs per multiply-add
    return (
        6
        * tokens
        * cfg["num_experts_per_tok"]
        * cfg["hidden_size"]
        * (cfg["moe_intermediate_size"])
        / 1e9
    )


def _timed_parent(name: str, timed: set[str]) -> str | None:
    """The nearest enclosing module that was timed (ModuleLists are never called)."""
    if name == "model":
        return None
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:cut]) in timed:
            return ".".join(parts[:cut])
    return "model"


def _rows(
    times: dict[str, tuple[int, float]], gflop: dict[str, float], moe_gflop: float
) -> list[ModuleRow]:
    children: dict[str, float] = defaultdict(float)
    timed = set(times)
    for name, (_calls, ms) in times.items():
        parent = _timed_parent(name, timed)
        if parent is not None:
            children[parent] += ms
    rows = []
    for name, (calls, ms) in times.items():
        flops = gflop.get(name, 0.0)
        if name.endswith(".ffn.experts"):
            flops = max(flops, moe_gflop)
        rows.append(ModuleRow(name, calls, ms, ms - children[name], flops))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ratios", default="4,128")
    parser.add_argument("--runner", default="auto", help="--moe-runner-backend")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    cuda = not args.smoke
    device = "cuda" if cuda else "cpu"
    ratios = [int(r) for r in args.ratios.split(",")]
    cfg = default_model_config(512, 0, 1) if args.smoke else wide_dsv4_config(ratios)
    tokens = min(args.tokens, 64) if args.smoke else args.tokens
    spec = LayerBuildSpec(dtype=torch.bfloat16, device=device, moe_runner=args.runner)
    model = DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_dict(cfg), spec)
    load_weights(model, random_weights(cfg, seed=0), LoadOptions(progress=False))
    model.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (tokens,), generator=gen).to(device)
    pos = torch.arange(tokens, device=device)
    run = torch.no_grad()(partial(model, ids, pos))
    clock = _Clock(cuda)
    run()  # compiles every Triton kernel of this shape
    totals = []
    for _ in range(args.repeats):
        begin = clock.mark()
        run()
        end = clock.mark()
        if cuda:
            torch.cuda.synchronize()
        totals.append(clock.ms(begin, end))
    prefill_ms = sorted(totals)[len(totals) // 2]
    times = _module_times(model, run, clock)
    gflop = _module_gflop(model, run)
    rows = _rows(times, gflop, _routed_moe_gflop(cfg, tokens))
    hooked_ms = times["model"][1]
    name = torch.cuda.get_device_name() if cuda else "cpu (smoke)"
    print(
        f"\nDSv4 wide prefill, {tokens} tokens, ratios {ratios}, runner {args.runner}, {name}\n"
        f"prefill (GPU part of TTFT): {prefill_ms:.2f} ms; with the per-module events: "
        f"{hooked_ms:.2f} ms\n"
    )
    print(
        f"{'module':<34} {'calls':>5} {'ms':>9} {'self ms':>9} {'%':>6} {'GFLOP':>9} "
        f"{'TFLOP/s':>7} {'%peak':>6}"
    )
    for row in sorted(rows, key=lambda r: r.name if r.name != "model" else ""):
        print(row.line(hooked_ms, args.peak_tflops))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"tokens": tokens, "prefill_ms": prefill_ms, "rows": [asdict(r) for r in rows]}, f
            )


if __name__ == "__main__":
    main()
