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

The attention's self time is split further (rows ``layers.N.attn:part``, CUDA events around the
calls): ``compressor.project`` / ``compressor.append`` (the KV compressor's projection and its
pooling into entries), the same two of the indexer's compressor, ``indexer.queries`` (its q and
head weights), ``indexer.select`` (its scores and top-k), ``core`` (the attention over window
rows, entries and sink: the Triton kernel or the torch path) and ``rest`` (the attention's self
time outside those: RoPE, norms, the window ring, casts). The core's GFLOP is the useful work
(``4 * heads * head_dim`` per key a query sees: window rows plus its entries), counted the same
for both paths.

``--cores auto,torch`` profiles each setting in turn on the same model: ``auto`` is what the layer
picks (the kernel where Triton runs), ``torch`` forces the torch path (the reference).

Usage: python scripts/profile_prefill.py [--tokens 8192] [--ratios 4,128] [--runner auto]
       [--cores auto] [--json OUT.json]   (--smoke: the tiny default model on CPU, to check it)
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
from sglang.srt.layers.attention import dsv4_attention as attn_module
from sglang.srt.layers.attention.dsv4_attention import DeepseekV4Attention
from sglang.srt.layers.attention.dsv4_compressor import KVCompressor
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.loading import load_weights
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
            f"{self.name:<40} {self.calls:>5} {self.ms:>9.3f} {self.self_ms:>9.3f} "
            f"{100 * self.ms / total_ms:>6.1f} {self.gflop:>9.1f} {rate:>7.1f} {peak}"
        )


class Clock:
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


# (part label, path of the object under the attention module, method) timed inside attention
_ATTN_PARTS = (
    ("compressor.project", "compressor", "project"),
    ("compressor.append", "compressor", "append"),
    ("indexer.compressor.project", "indexer.compressor", "project"),
    ("indexer.compressor.append", "indexer.compressor", "append"),
    ("indexer.queries", "indexer", "queries"),
    ("indexer.select", "indexer", "select"),
    ("indexer.select", "indexer", "pick"),  # the kernel path's form of select
)
_CORE_FUNCTIONS = ("dsv4_attention", "sparse_prefill_attention")  # names in attn_module


def timed_call(
    fn: Callable[..., Any], key: Callable[[], str], clock: Clock, spans: dict[str, list]
) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        begin = clock.mark()
        out = fn(*args, **kwargs)
        spans[key()].append((begin, clock.mark()))
        return out

    return call


def time_parts(
    model: nn.Module,
    layer_type: type,
    methods: tuple[tuple[str, str, str], ...],
    functions: tuple[tuple[str, Any, str], ...],
    clock: Clock,
    spans: dict[str, list],
) -> Callable[[], None]:
    """Wrap the inner calls of every ``layer_type`` module so each records a span under
    ``<module name>:<label>``: ``methods`` as (label, attribute path under the module, method),
    ``functions`` as (label, python module, function name), shared by all layers and keyed by
    the layer running now. Returns the undo."""
    undo: list[Callable[[], None]] = []
    current = ["?"]  # the layer running now (the functions are shared)
    for name, module in model.named_modules():
        if not isinstance(module, layer_type):
            continue

        def enter(_m: nn.Module, _a: object, name: str = name) -> None:
            current[0] = name

        undo.append(module.register_forward_pre_hook(enter).remove)
        for label, path, method in methods:
            obj: Any = module
            for attr in filter(None, path.split(".")):
                obj = getattr(obj, attr, None)
            if obj is None:
                continue
            key = f"{name}:{label}"
            setattr(obj, method, timed_call(getattr(obj, method), lambda k=key: k, clock, spans))
            undo.append(partial(obj.__dict__.pop, method))
    for label, owner, fn_name in functions:
        plain = getattr(owner, fn_name)
        timed = timed_call(plain, lambda label=label: f"{current[0]}:{label}", clock, spans)
        setattr(owner, fn_name, timed)
        undo.append(partial(setattr, owner, fn_name, plain))

    def restore() -> None:
        for u in reversed(undo):
            u()

    return restore


def _time_attention_parts(
    model: nn.Module, clock: Clock, spans: dict[str, list]
) -> Callable[[], None]:
    """DSv4: ``_ATTN_PARTS`` per attention layer and the core functions under ``:core``."""
    cores = tuple(("core", attn_module, fn) for fn in _CORE_FUNCTIONS)
    return time_parts(model, DeepseekV4Attention, _ATTN_PARTS, cores, clock, spans)


def median_run_ms(run: Callable[[], object], clock: Clock, repeats: int) -> float:
    """Median of ``repeats`` timed runs after one untimed (it compiles the Triton kernels)."""
    run()
    totals = []
    for _ in range(repeats):
        begin = clock.mark()
        run()
        end = clock.mark()
        if clock.cuda:
            torch.cuda.synchronize()
        totals.append(clock.ms(begin, end))
    return sorted(totals)[len(totals) // 2]


def gpu_busy_ms(run: Callable[[], object]) -> tuple[float, int]:
    """(summed GPU kernel time in ms, kernel count) of one run under the torch profiler. Against
    the run's wall time on the GPU clock this says how much of it the GPU sat idle waiting for
    the host to launch work."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e3, len(kernels)


def print_host_trace(run: Callable[[], object], cuda: bool, top: int = 12) -> None:
    """One run under the torch profiler with host activity: the CUDA runtime calls that can stall
    the host (synchronise, copies, malloc / free) and the ops with the most host time, to say why
    the GPU waits."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    stalls = ("Synchronize", "Memcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc")
    print("\nhost: CUDA runtime calls that can stall, and the ops with the most host time")
    print(f"{'call / op':<60} {'count':>6} {'self host ms':>12}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total):
        if any(s in e.key for s in stalls):
            print(f"{e.key[:60]:<60} {e.count:>6} {e.self_cpu_time_total / 1e3:>12.3f}")
    print("--")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"{e.key[:60]:<60} {e.count:>6} {e.self_cpu_time_total / 1e3:>12.3f}")


def print_module_table(
    title: str, prefill_ms: float, hooked_ms: float, rows: list[ModuleRow], peak_tflops: float
) -> None:
    print(
        f"\n{title}\nprefill (GPU part of TTFT): {prefill_ms:.2f} ms; with the per-module "
        f"events: {hooked_ms:.2f} ms\n"
    )
    print(
        f"{'module':<40} {'calls':>5} {'ms':>9} {'self ms':>9} {'%':>6} {'GFLOP':>9} "
        f"{'TFLOP/s':>7} {'%peak':>6}"
    )
    for row in sorted(rows, key=lambda r: r.name if r.name != "model" else ""):
        print(row.line(hooked_ms, peak_tflops))


PartTimer = Callable[[nn.Module, Clock, dict[str, list]], Callable[[], None]]


def module_times(
    model: nn.Module,
    run: Callable[[], object],
    clock: Clock,
    time_parts: PartTimer | None = None,
) -> dict[str, tuple[int, float]]:
    """name -> (calls, inclusive ms) of every module up to MAX_DEPTH and of the attention's parts
    (``layers.N.attn:part``; ``time_parts`` wraps them, default DSv4's), from one hooked run."""
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
    restore = (time_parts or _time_attention_parts)(model, clock, spans)
    try:
        run()
        if clock.cuda:
            torch.cuda.synchronize()
    finally:
        restore()
        for h in handles:
            h.remove()
    return {k: (len(v), sum(clock.ms(b, e) for b, e in v)) for k, v in spans.items()}


def module_gflop(model: nn.Module, run: Callable[[], object]) -> dict[str, float]:
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


def _core_gflop(cfg: dict[str, Any], tokens: int, ratio: int) -> float:
    """Useful FLOPs of one attention core over a fresh ``tokens`` prompt: ``q . k`` and ``p . v``
    (2 FLOPs a multiply-add each) for every key a query sees (window rows, then its entries)."""
    p = torch.arange(tokens, dtype=torch.float64)
    keys = torch.clamp(p + 1, max=cfg["sliding_window"])
    if ratio == 4:
        keys += torch.clamp(torch.div(p + 1, ratio, rounding_mode="floor"), max=cfg["index_topk"])
    elif ratio:
        keys += torch.div(p + 1, ratio, rounding_mode="floor")
    return float(keys.sum()) * 4 * cfg["num_attention_heads"] * cfg["head_dim"] / 1e9


def _timed_parent(name: str, timed: set[str]) -> str | None:
    """The nearest enclosing module that was timed (ModuleLists are never called); an attention
    part's parent is its attention module."""
    if name == "model":
        return None
    if ":" in name:
        return name.split(":")[0]
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:cut]) in timed:
            return ".".join(parts[:cut])
    return "model"


def module_rows(
    times: dict[str, tuple[int, float]],
    gflop: dict[str, float],
    moe_gflop: float,
    core_gflop: dict[str, float],
) -> list[ModuleRow]:
    """One row per timed module and attention part, plus ``layers.N.attn:rest`` (the attention's
    self time outside its parts). ``core_gflop``: attention module name -> its core's FLOPs."""
    children: dict[str, float] = defaultdict(float)
    parts: dict[str, float] = defaultdict(float)
    timed = {k for k in times if ":" not in k}
    for name, (_calls, ms) in times.items():
        parent = _timed_parent(name, timed)
        if parent is not None and ":" not in name:
            children[parent] += ms
        elif parent is not None:
            parts[parent] += ms
    rows = []
    for name, (calls, ms) in times.items():
        flops = gflop.get(name, 0.0)
        if name.endswith(".ffn.experts"):
            flops = max(flops, moe_gflop)
        if name.endswith(":core"):
            flops = core_gflop.get(name.split(":")[0], 0.0)
        rows.append(ModuleRow(name, calls, ms, ms - children[name], flops))
    for attn, ms in parts.items():
        calls = times[attn][0]
        rest = times[attn][1] - children[attn] - ms
        rows.append(ModuleRow(f"{attn}:rest", calls, rest, rest, 0.0))
    return rows


_LAYER_KERNEL_REASON = attn_module.prefill_kernel_reason


def _force_torch_core(force: bool) -> None:
    """Make the attention layers take the torch core (``--cores torch``) or pick it themselves."""

    def forced(q: torch.Tensor, key_dtype: torch.dtype) -> str | None:
        return "--cores torch"

    attn_module.prefill_kernel_reason = forced if force else _LAYER_KERNEL_REASON


_COMPRESSOR_KERNEL = KVCompressor._use_prefill_kernel


def _force_torch_compressor(force: bool) -> None:
    """Make the compressors' prefill take the torch chain (``--cores compressor-torch``: the
    attention kernels stay) or the fused kernel where it fits."""

    def forced(*args: object) -> bool:
        return False

    KVCompressor._use_prefill_kernel = forced if force else _COMPRESSOR_KERNEL  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ratios", default="4,128")
    parser.add_argument("--runner", default="auto", help="--moe-runner-backend")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--cores",
        default="auto",
        help="comma list of auto (the layer's pick), torch (attention core and indexer select), "
        "compressor-torch (the compressors' prefill torch chain, kernels elsewhere)",
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--host-trace", action="store_true", help="also the host-side profile of one run"
    )
    args = parser.parse_args()
    cuda = not args.smoke
    device = "cuda" if cuda else "cpu"
    ratios = [int(r) for r in args.ratios.split(",")]
    cfg = default_model_config(512, 0, 1) if args.smoke else wide_dsv4_config(ratios)
    tokens = min(args.tokens, 64) if args.smoke else args.tokens
    spec = LayerBuildSpec(dtype=torch.bfloat16, device=device, moe_runner=args.runner)
    model = DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_dict(cfg), spec)
    # drawn on the GPU: the wide model's weights take about a minute on the CPU
    load_weights(model, random_weights(cfg, seed=0, device=device), LoadOptions(progress=False))
    model.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (tokens,), generator=gen).to(device)
    pos = torch.arange(tokens, device=device)
    run = torch.no_grad()(partial(model, ids, pos))
    clock = Clock(cuda)
    core_gflop = {
        name: _core_gflop(cfg, tokens, m.ratio)
        for name, m in model.named_modules()
        if isinstance(m, DeepseekV4Attention)
    }
    name = torch.cuda.get_device_name() if cuda else "cpu (smoke)"
    results = []
    for core in args.cores.split(","):
        if core not in ("auto", "torch", "compressor-torch"):
            raise SystemExit(f"--cores takes auto, torch and compressor-torch, got {core!r}")
        _force_torch_core(core == "torch")
        _force_torch_compressor(core == "compressor-torch")
        prefill_ms = median_run_ms(run, clock, args.repeats)
        times = module_times(model, run, clock)
        gflop = module_gflop(model, run)
        rows = module_rows(times, gflop, _routed_moe_gflop(cfg, tokens), core_gflop)
        title = (
            f"DSv4 wide prefill, {tokens} tokens, ratios {ratios}, runner {args.runner}, "
            f"attention core {core}, {name}"
        )
        print_module_table(title, prefill_ms, times["model"][1], rows, args.peak_tflops)
        if cuda:
            busy, launches = gpu_busy_ms(run)
            print(
                f"GPU kernels: {busy:.2f} ms busy in {launches} launches, "
                f"{100 * (1 - busy / prefill_ms):.0f}% of the prefill's {prefill_ms:.2f} ms idle"
            )
        if args.host_trace:
            print_host_trace(run, cuda)
        results.append({"core": core, "prefill_ms": prefill_ms, "rows": [asdict(r) for r in rows]})
    _force_torch_core(False)
    _force_torch_compressor(False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": tokens, "runs": results}, f)


if __name__ == "__main__":
    main()
