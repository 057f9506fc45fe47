"""MoE layer time per shape, batch size and runner on one GPU, against the H200's ceilings.

For each case: median time under CUDA-graph replay, achieved bandwidth (bytes of the expert
weights actually touched plus activations in/out, each once) and TFLOP/s, and the fraction of the
roofline floor max(bytes / BW, flops / peak) the run reaches. Ceilings are those the device notes
measured on these H200s: 4.3 TB/s copy, 790 TFLOP/s bf16 matmul; FP8 peak taken as 2x bf16.

Runners: ``triton``, ``torch``, ``deep_gemm`` (``auto``: its measured choice, the path table
``srt/layers/moe/moe_runner/path_table.py``), ``deep_gemm:masked`` and ``deep_gemm:contiguous``
(one layout forced). Each is timed the way the engine runs it at that size (``mode`` column):
under CUDA-graph replay at decode sizes (M <= ``--graph-max-m``), eagerly above (prefill chunks
are never captured), and the contiguous layout always eagerly (it reads its size back to the
host, so it cannot be captured). ``ref us`` is the reference
fused MoE (SGLang 0.5.23's Triton path with its best H200 configs, measured on this GPU model,
``shared/design/performance_targets.md``) where that table has the case, and
``ref/ours`` its time over ours (> 1: ours is faster).

With ``--profile`` it prints, for each case instead, the GPU time of each kernel of one call
(torch profiler, 10 calls averaged): where a layer's time goes.

With ``--auto`` it times the ``deep_gemm`` runner's ``auto`` against each layout forced
(``triton``, ``deep_gemm:contiguous``, ``deep_gemm:masked``) at every size and prints, per size,
auto's choice, every time, the fastest and auto's ratio to it (the target: within 3%).
``scripts/tune_moe_paths.py`` measures the same paths the same way and writes the table auto
reads.

Usage: python scripts/bench_moe.py [--shapes dsv4,k3] [--batches 1,8,32,128,512,2048,8192]
       [--runners triton] [--profile] [--auto]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton
from tqdm import tqdm

from sglang.bench_table import markdown_table
from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner import MoERunConfig, MoERunner, create_moe_runner
from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoERunner
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.test.moe_model_cases import Shape

BF16 = torch.bfloat16
# shape, dtype, runner, mode, M, us, GB/s, TFLOP/s, share of the roofline, the reference's us
ResultRow = tuple[str, str, str, str, int, float, float, float, float, int | None]
BW_BYTES_S = 4.3e12
BF16_FLOPS = 790e12

# The reference's times in us, (shape, dtype, M) -> us (performance_targets.md, one H200).
REFERENCE_US = {
    ("dsv4", "bf16", 1): 82,
    ("dsv4", "bf16", 128): 2740,
    ("dsv4", "bf16", 512): 3014,
    ("dsv4", "bf16", 2048): 3275,
    ("dsv4", "bf16", 8192): 6346,
    ("dsv4", "fp8", 1): 53,
    ("dsv4", "fp8", 128): 1437,
    ("dsv4", "fp8", 512): 1633,
    ("dsv4", "fp8", 2048): 2041,
    ("dsv4", "fp8", 8192): 5305,
    ("k3", "bf16", 1): 263,
    ("k3", "bf16", 512): 6053,
    ("k3", "bf16", 2048): 7257,
    ("k3", "bf16", 8192): 19751,
    ("k3", "fp8", 1): 146,
    ("k3", "fp8", 512): 3368,
    ("k3", "fp8", 2048): 5998,
    ("k3", "fp8", 8192): 16331,
}


SHAPES = {
    "dsv4": Shape("DeepSeek V4 (E=256 top-6 H=4096 I=2048)", 256, 6, 4096, 2048, "swiglu"),
    "k3": Shape("Kimi K3 latent (E=384 top-16 H=3584 I=3072)", 384, 16, 3584, 3072, "situ"),
}


def random_bf16_experts(
    num_experts: int,
    hidden: int,
    inter: int,
    *,
    gen: torch.Generator,
    device: torch.device | str,
    scales: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 experts in the runners' layout, drawn in this order: ``w13 [E, 2*inter,
    hidden]`` times ``scales[0]``, then ``w2 [E, hidden, inter]`` times ``scales[1]``."""
    w13 = (
        torch.randn(num_experts, 2 * inter, hidden, device=device, generator=gen, dtype=BF16)
        * scales[0]
    )
    w2 = (
        torch.randn(num_experts, hidden, inter, device=device, generator=gen, dtype=BF16)
        * scales[1]
    )
    return w13, w2


def make_weights(shape: Shape, fp8: bool, device: torch.device) -> ExpertWeights:
    gen = torch.Generator(device).manual_seed(0)
    w13, w2 = random_bf16_experts(
        shape.experts, shape.hidden, shape.inter, gen=gen, device=device, scales=(0.02, 0.02)
    )
    if not fp8:
        return ExpertWeights(w13, w2)
    q13, s13 = block_quant_weight_fp8(w13, (128, 128))
    del w13
    q2, s2 = block_quant_weight_fp8(w2, (128, 128))
    return ExpertWeights(q13, q2, s13, s2)


def make_batch(shape: Shape, m: int, device: torch.device) -> tuple[torch.Tensor, TopKOutput]:
    gen = torch.Generator(device).manual_seed(m)
    x = torch.randn(m, shape.hidden, device=device, generator=gen, dtype=torch.bfloat16)
    scores = torch.rand(m, shape.experts, device=device, generator=gen)
    w, ids = scores.topk(shape.top_k, dim=-1)
    return x, TopKOutput((w / w.sum(-1, keepdim=True)).float(), ids.int())


def floor_terms(shape: Shape, m: int, topk: TopKOutput, fp8: bool) -> tuple[float, float]:
    touched = int(torch.unique(topk.topk_ids).numel())
    elem = 1 if fp8 else 2
    weight_bytes = touched * 3 * shape.hidden * shape.inter * elem
    act_bytes = 2 * m * shape.hidden * 2
    flops = 6.0 * m * shape.top_k * shape.hidden * shape.inter
    return weight_bytes + act_bytes, flops


def make_runner(name: str, config: MoERunConfig) -> MoERunner:
    """``name`` or ``deep_gemm:<layout>``."""
    if name.startswith("deep_gemm:"):
        return DeepGemmMoERunner(config, layout=name.split(":", 1)[1])  # type: ignore[arg-type]
    return create_moe_runner(name, config)


# Decode batches up to this size replay CUDA graphs in the engine; larger batches are prefill
# chunks, which run eagerly.
GRAPH_MAX_M = 512
# The layouts auto chooses among, each forced (bench names: runner[:layout]).
FORCED_LAYOUTS = {
    "triton": "triton",
    "deep_gemm:contiguous": "deep_gemm_contiguous",
    "deep_gemm:masked": "deep_gemm_masked",
}


def engine_mode(runner: MoERunner, m: int, graph_max_m: int = GRAPH_MAX_M) -> str:
    """How the engine runs ``runner`` on ``m`` tokens: ``graph`` (decode-sized, capturable) or
    ``eager`` (prefill-sized, or the contiguous layout, which reads its size back)."""
    contiguous = isinstance(runner, DeepGemmMoERunner) and runner.layout == "contiguous"
    return "eager" if contiguous or m > graph_max_m else "graph"


def time_ms(runner: MoERunner, fn, m: int, graph_max_m: int = GRAPH_MAX_M) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    """Median ms of ``fn`` in the mode the engine would run it (:func:`engine_mode`)."""
    mode = engine_mode(runner, m, graph_max_m)
    if mode == "eager":
        return triton.testing.do_bench(fn, warmup=25, rep=200), mode
    return triton.testing.do_bench_cudagraph(fn, rep=200), mode


def masked_too_large(shape: Shape, m: int) -> bool:
    """[E, M, H] slabs past 4 GB: the masked layout is for decode sizes."""
    return m * shape.experts * shape.hidden > 2**31


def measure_paths(
    shape: Shape,
    fp8: bool,
    batches: list[int],
    device: torch.device,
    graph_max_m: int = GRAPH_MAX_M,
    with_auto: bool = False,
) -> dict[int, dict[str, tuple[float, str]]]:
    """``{M: {path: (us, mode)}}`` for the layouts auto chooses among (path-table names), and
    with ``with_auto`` the ``deep_gemm`` runner's own choice as ``auto`` (its mode slot also
    names the layout it chose)."""
    weights = make_weights(shape, fp8, device)
    config = MoERunConfig(shape.activation, 10.0 if shape.activation == "swiglu" else None)
    out: dict[int, dict[str, tuple[float, str]]] = {}
    names = list(FORCED_LAYOUTS) + (["deep_gemm"] if with_auto else [])
    for m in batches:
        x, topk = make_batch(shape, m, device)
        row: dict[str, tuple[float, str]] = {}
        for name in names:
            if name == "deep_gemm:masked" and masked_too_large(shape, m):
                continue
            runner = make_runner(name, config)
            ms, mode = time_ms(runner, partial(runner.run, x, topk, weights), m, graph_max_m)
            if name == "deep_gemm":
                assert isinstance(runner, DeepGemmMoERunner)
                capturing = mode == "graph"
                chosen = _auto_layout(runner, shape, fp8, m, capturing)
                row["auto"] = (ms * 1e3, f"{mode}, chose {chosen}")
            else:
                row[FORCED_LAYOUTS[name]] = (ms * 1e3, mode)
            torch.cuda.empty_cache()
        out[m] = row
    del weights
    torch.cuda.empty_cache()
    return out


def _auto_layout(
    runner: DeepGemmMoERunner, shape: Shape, fp8: bool, m: int, capturing: bool
) -> str:
    from sglang.srt.layers.moe.moe_runner.deep_gemm import choose_layout, measured_layout
    from sglang.srt.layers.moe.moe_runner.path_table import MoeShape

    key = MoeShape(shape.experts, shape.top_k, shape.hidden, shape.inter)
    return measured_layout(key, fp8, m, capturing) or choose_layout(m, fp8, capturing)


def print_auto_table(rows: list[tuple[str, str, int, dict[str, tuple[float, str]]]]) -> bool:
    """Auto against each forced layout; True when auto is within 3% of the fastest everywhere."""
    print(
        "\n| shape | dtype | M | auto us (mode, choice) | triton us | contiguous us | masked us "
        "| fastest | auto / fastest |\n|---|---|---:|---|---:|---:|---:|---|---:|"
    )
    ok = True
    for shape_key, dtype, m, row in rows:
        forced = {p: us for p, (us, _) in row.items() if p != "auto"}
        best = min(forced, key=lambda p: forced[p])
        auto_us, how = row["auto"]
        ratio = auto_us / forced[best]
        ok &= ratio <= 1.03

        cells = [
            f"{row[p][0]:.1f} ({row[p][1]})" if p in row else "-"
            for p in ("triton", "deep_gemm_contiguous", "deep_gemm_masked")
        ]
        print(
            f"| {shape_key} | {dtype} | {m} | {auto_us:.1f} ({how}) | {' | '.join(cells)} | "
            f"{best} | {ratio:.3f} |"
        )
    print(f"\nauto within 3% of the fastest path at every size: {'yes' if ok else 'NO'}")
    return ok


def profile_rows(runner: MoERunner, fn, label: str) -> None:  # type: ignore[no-untyped-def]
    """Per-kernel GPU time of one call of ``fn`` (mean over 10), largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / 10
    print(f"\n{label}: {total:.0f} us of GPU time a call")
    print("| kernel | calls a call | us a call | share |\n|---|---:|---:|---:|")
    for e in events[:12]:
        us = e.device_time_total / 10
        print(f"| {e.key[:70]} | {e.count // 10} | {us:.1f} | {us / total:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="dsv4,k3")
    parser.add_argument("--batches", default="1,8,32,128,512,2048,8192")
    parser.add_argument("--graph-max-m", type=int, default=GRAPH_MAX_M)
    parser.add_argument("--auto", action="store_true", help="deep_gemm auto vs each layout")
    parser.add_argument("--runners", default="triton")
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[ResultRow] = []
    cases = [(s, d) for s in args.shapes.split(",") for d in args.dtypes.split(",")]
    if args.auto:
        auto_rows = []
        for shape_key, dtype in tqdm(cases, desc="shapes"):
            measured = measure_paths(
                SHAPES[shape_key], dtype == "fp8", batches, device, args.graph_max_m, True
            )
            auto_rows += [(shape_key, dtype, m, row) for m, row in measured.items()]
        print_auto_table(auto_rows)
        return
    for shape_key, dtype in tqdm(cases, desc="shapes"):
        shape = SHAPES[shape_key]
        fp8 = dtype == "fp8"
        weights = make_weights(shape, fp8, device)
        config = MoERunConfig(shape.activation, 10.0 if shape.activation == "swiglu" else None)
        for runner_name in args.runners.split(","):
            runner = make_runner(runner_name, config)
            for m in batches:
                if runner_name == "deep_gemm:masked" and masked_too_large(shape, m):
                    continue
                x, topk = make_batch(shape, m, device)
                if args.profile:
                    label = f"{shape_key} {dtype} {runner_name} M={m}"
                    profile_rows(runner, partial(runner.run, x, topk, weights), label)
                    continue
                fn = partial(runner.run, x, topk, weights)
                ms, mode = time_ms(runner, fn, m, args.graph_max_m)
                nbytes, flops = floor_terms(shape, m, topk, fp8)
                peak = BF16_FLOPS * (2 if fp8 else 1)
                floor_ms = max(nbytes / BW_BYTES_S, flops / peak) * 1e3
                ref = REFERENCE_US.get((shape_key, dtype, m))
                rows.append(
                    (
                        shape_key,
                        dtype,
                        runner_name,
                        mode,
                        m,
                        ms * 1e3,
                        nbytes / (ms * 1e6),
                        flops / (ms * 1e9),
                        floor_ms / ms,
                        ref,
                    )
                )
                torch.cuda.empty_cache()
        del runner, weights  # free this shape's experts before the next
        torch.cuda.empty_cache()
    print("\n" + results_table(rows))


def results_table(rows: list[ResultRow]) -> str:
    """The Markdown table of the timed cases, one line each."""
    head = (
        "shape", "dtype", "runner", "mode", "M", "time us", "GB/s", "TFLOP/s", "of roofline",
        "ref us", "ref/ours",
    )  # fmt: skip
    cells = [
        (
            shape_key,
            dtype,
            runner_name,
            mode,
            m,
            f"{us:.1f}",
            f"{gbs:.0f}",
            f"{tflops:.1f}",
            f"{frac:.0%}",
            ref or "-",
            f"{ref / us:.2f}" if ref else "-",
        )
        for shape_key, dtype, runner_name, mode, m, us, gbs, tflops, frac, ref in rows
    ]
    return markdown_table(head, cells, align="llllrrrrrrr")


if __name__ == "__main__":
    main()
