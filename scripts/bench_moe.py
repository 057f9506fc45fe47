"""MoE layer time per shape, batch size and runner on one GPU, against the H200's ceilings.

For each case: median time under CUDA-graph replay, achieved bandwidth (bytes of the expert
weights actually touched plus activations in/out, each once) and TFLOP/s, and the fraction of the
roofline floor max(bytes / BW, flops / peak) the run reaches. Ceilings are those the device notes
measured on these H200s: 4.3 TB/s copy, 790 TFLOP/s bf16 matmul; FP8 peak taken as 2x bf16.

Usage: python scripts/bench_moe.py [--shapes dsv4,k3] [--batches 1,8,32,128,512] [--runners triton]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import triton
from tqdm import tqdm

from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.moe_runner import MoERunConfig, create_moe_runner
from sglang.srt.layers.moe.topk import TopKOutput

BW_BYTES_S = 4.3e12
BF16_FLOPS = 790e12


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
    w13 = torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(shape.experts, shape.hidden, shape.inter, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="dsv4,k3")
    parser.add_argument("--batches", default="1,8,32,128,512")
    parser.add_argument("--runners", default="triton")
    parser.add_argument("--dtypes", default="bf16,fp8")
    args = parser.parse_args()
    device = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    cases = [(s, d, r) for s in args.shapes.split(",") for d in args.dtypes.split(",") for r in args.runners.split(",")]
    for shape_key, dtype, runner_name in tqdm(cases, desc="shapes"):
        shape = SHAPES[shape_key]
        fp8 = dtype == "fp8"
        weights = make_weights(shape, fp8, device)
        runner = create_moe_runner(runner_name, MoERunConfig(shape.activation, 10.0 if shape.activation == "swiglu" else None))
        for m in batches:
            x, topk = make_batch(shape, m, device)
            ms = triton.testing.do_bench_cudagraph(lambda: runner.run(x, topk, weights), rep=200)
            nbytes, flops = floor_terms(shape, m, topk, fp8)
            peak = BF16_FLOPS * (2 if fp8 else 1)
            floor_ms = max(nbytes / BW_BYTES_S, flops / peak) * 1e3
            rows.append((shape_key, dtype, runner_name, m, ms * 1e3, nbytes / (ms * 1e6), flops / (ms * 1e9), floor_ms / ms))
        del weights
        torch.cuda.empty_cache()
    print(f"\n{'shape':<6} {'dtype':<5} {'runner':<8} {'M':>5} {'time us':>9} {'GB/s':>8} {'TFLOP/s':>8} {'of roofline':>12}")
    for shape_key, dtype, runner_name, m, us, gbs, tflops, frac in rows:
        print(f"{shape_key:<6} {dtype:<5} {runner_name:<8} {m:>5} {us:>9.1f} {gbs:>8.0f} {tflops:>8.1f} {frac:>11.0%}")


if __name__ == "__main__":
    main()
