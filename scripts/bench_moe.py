"""MoE layer time per shape, batch size and runner on one GPU, against the H200's ceilings.

For each case: median time under CUDA-graph replay, achieved bandwidth (bytes of the expert
weights actually touched plus activations in/out, each once) and TFLOP/s, and the fraction of the
roofline floor max(bytes / BW, flops / peak) the run reaches. Ceilings are those the device notes
measured on these H200s: 4.3 TB/s copy, 790 TFLOP/s bf16 matmul; FP8 peak taken as 2x bf16.

Runners: ``triton``, ``torch``, ``deep_gemm`` (its token-count choice), ``deep_gemm:masked`` and
``deep_gemm:contiguous`` (one layout forced). The contiguous layout reads its size back to the host,
so it cannot be captured: it is timed eagerly (``mode`` column). ``ref us`` is the reference
fused MoE (SGLang 0.5.23's Triton path with its best H200 configs, measured on this GPU model,
``shared/design/performance_targets.md``) where that table has the case, and
``ref/ours`` its time over ours (> 1: ours is faster).

With ``--profile`` it prints, for each case instead, the GPU time of each kernel of one call
(torch profiler, 10 calls averaged): where a layer's time goes.

Usage: python scripts/bench_moe.py [--shapes dsv4,k3] [--batches 1,8,32,128,512] [--runners triton]
       [--profile]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial

import torch
import triton
from tqdm import tqdm

from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner import MoERunConfig, MoERunner, create_moe_runner
from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoERunner
from sglang.srt.layers.moe.topk import TopKOutput

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


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    activation: str


SHAPES = {
    "dsv4": Shape("DeepSeek V4 (E=256 top-6 H=4096 I=2048)", 256, 6, 4096, 2048, "swiglu"),
    "k3": Shape("Kimi K3 latent (E=384 top-16 H=3584 I=3072)", 384, 16, 3584, 3072, "situ"),
}


def make_weights(shape: Shape, fp8: bool, device: torch.device) -> ExpertWeights:
    gen = torch.Generator(device).manual_seed(0)
    w13 = (
        torch.randn(
            shape.experts,
            2 * shape.inter,
            shape.hidden,
            device=device,
            generator=gen,
            dtype=torch.bfloat16,
        )
        * 0.02
    )
    w2 = (
        torch.randn(
            shape.experts,
            shape.hidden,
            shape.inter,
            device=device,
            generator=gen,
            dtype=torch.bfloat16,
        )
        * 0.02
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


def time_ms(runner: MoERunner, fn) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    """CUDA-graph replay where the runner can be captured at this size, else eager."""
    eager = isinstance(runner, DeepGemmMoERunner) and runner.layout == "contiguous"
    if eager:
        return triton.testing.do_bench(fn, warmup=25, rep=200), "eager"
    return triton.testing.do_bench_cudagraph(fn, rep=200), "graph"


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
    parser.add_argument("--batches", default="1,8,32,128,512")
    parser.add_argument("--runners", default="triton")
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    cases = [(s, d) for s in args.shapes.split(",") for d in args.dtypes.split(",")]
    for shape_key, dtype in tqdm(cases, desc="shapes"):
        shape = SHAPES[shape_key]
        fp8 = dtype == "fp8"
        weights = make_weights(shape, fp8, device)
        config = MoERunConfig(shape.activation, 10.0 if shape.activation == "swiglu" else None)
        for runner_name in args.runners.split(","):
            runner = make_runner(runner_name, config)
            for m in batches:
                if runner_name == "deep_gemm:masked" and m * shape.experts * shape.hidden > 2**31:
                    continue  # [E, M, H] slabs past 4 GB: the layout is for decode sizes
                x, topk = make_batch(shape, m, device)
                if args.profile:
                    label = f"{shape_key} {dtype} {runner_name} M={m}"
                    profile_rows(runner, partial(runner.run, x, topk, weights), label)
                    continue
                ms, mode = time_ms(runner, partial(runner.run, x, topk, weights))
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
    print(
        "\n| shape | dtype | runner | mode | M | time us | GB/s | TFLOP/s | of roofline | ref us | "
        "ref/ours |"
        "\n|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for shape_key, dtype, runner_name, mode, m, us, gbs, tflops, frac, ref in rows:
        ratio = f"{ref / us:.2f}" if ref else "-"
        print(
            f"| {shape_key} | {dtype} | {runner_name} | {mode} | {m} | {us:.1f} | {gbs:.0f} | "
            f"{tflops:.1f} | {frac:.0%} | {ref or '-'} | {ratio} |"
        )


if __name__ == "__main__":
    main()
