"""The MXFP4 W4A16 fused MoE against our bf16 and FP8 Triton runners, at DeepSeek V4 and Kimi K3
expert shapes, on one GPU.

For each shape and M: the time of one MoE call (µs) of
- ``mxfp4``: ``fused_experts_mxfp4`` on the prepared resident layout (``--layout plain``: the
  checkpoint layout as it is),
- ``bf16``: ``fused_experts`` on the same experts dequantised to bf16 (exact),
- ``fp8``: ``fused_experts`` on those bf16 weights block-quantised to FP8 (128 x 128 scales),
each with its tuned tables where present; the speed-up of MXFP4 over bf16; and the bandwidth MXFP4
reaches on the bytes it must read (the 4-bit weights and UE8M0 scales of the experts the routing
touches, counted from the routing of the same run), as GB/s and as a share of a device-to-device
copy's bandwidth measured in the same run (bytes read + written over time).

Timing: ``--rotate`` calls with different inputs and routings (uniform random top-k) are captured
in one CUDA graph and replayed; the median replay time over ``--rotate`` is a call. Consecutive
calls touch different experts, so L2 (about 50 MB) does not serve the weights at decode sizes.
Prints one markdown table.

Usage: python scripts/bench_moe_mxfp4.py [--shapes dsv4,k3] [--batches 1,2,4,...,8192]
       [--rotate 8] [--layout prepared|plain] [--runners mxfp4,bf16,fp8] [--k3-experts 384]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
import triton

from sglang.kernels.ops.moe.fused_moe import fused_experts
from sglang.kernels.ops.moe.fused_moe_mxfp4 import fused_experts_mxfp4_weights
from sglang.kernels.ops.moe.mxfp4_weights import Mxfp4MoeWeights, prepare_mxfp4_moe_weights
from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8
from sglang.kernels.ops.quant.mxfp4 import MXFP4_GROUP
from sglang.test.moe_model_cases import Shape
from sglang.test.mxfp4_experts import random_mxfp4_experts, random_routing

DEFAULT_BATCHES = "1,2,4,8,16,32,64,128,512,2048,8192"


def shapes(k3_experts: int) -> dict[str, Shape]:
    return {
        "dsv4": Shape("DeepSeek V4 E=256 top6 H=4096 I=2048", 256, 6, 4096, 2048, "swiglu", 10.0),
        "k3": Shape(
            f"Kimi K3 latent E={k3_experts} top16 H=3584 I=3072", k3_experts, 16, 3584, 3072,
            "situ", None,
        ),
    }  # fmt: skip


def expert_bytes(shape: Shape) -> int:
    """MXFP4 bytes of one expert: 3*H*I values at half a byte, one scale byte per 32."""
    values = 3 * shape.hidden * shape.inter
    return values // 2 + values // MXFP4_GROUP


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(partial(dst.copy_, src), warmup=10, rep=100)
    return 2 * nbytes / (ms * 1e-3)


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # hidden, topk_weights, topk_ids
Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], object]


def graph_us(run: Runner, batches: list[Batch]) -> float:
    """One call's time: ``run`` on each batch (its own output) captured in one CUDA graph, the
    median replay over the number of batches."""
    outs = [torch.empty_like(x) for x, _, _ in batches]

    def run_all() -> None:
        for (x, tw, ids), out in zip(batches, outs, strict=True):
            run(x, tw, ids, out)

    run_all()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(run_all, rep=200) * 1e3 / len(batches)


def runners_for(shape: Shape, layout: str, names: list[str]) -> dict[str, Runner]:
    """The MoE calls to time, on one set of random experts (MXFP4, and for the others their exact
    bf16 dequantisation and its block-FP8 quantisation)."""
    w13, w2, s13, s2 = random_mxfp4_experts(
        shape.experts, shape.hidden, shape.inter, seed=0, device="cuda"
    )
    if layout == "prepared":
        weights = prepare_mxfp4_moe_weights(w13, w2, s13, s2)
    else:
        weights = Mxfp4MoeWeights(w13, w2, s13, s2)
    act = {"activation": shape.activation, "swiglu_limit": shape.swiglu_limit}
    runners: dict[str, Runner] = {}
    if "mxfp4" in names:
        runners["mxfp4"] = partial(_run_mxfp4, weights, act)
    if {"bf16", "fp8"} & set(names):
        b13, b2 = weights.dequantized(torch.bfloat16)
        if "fp8" in names:
            q13, f13 = block_quant_weight_fp8(b13, (128, 128))
            q2, f2 = block_quant_weight_fp8(b2, (128, 128))
            fp8 = {"w13_scale": f13, "w2_scale": f2, "block_shape": (128, 128)}
            runners["fp8"] = partial(_run_fused, q13, q2, {**act, **fp8})
        if "bf16" in names:
            runners["bf16"] = partial(_run_fused, b13, b2, act)
    return runners


def _run_mxfp4(weights: Mxfp4MoeWeights, act: dict[str, object], x: torch.Tensor,
               tw: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> object:  # fmt: skip
    return fused_experts_mxfp4_weights(x, weights, tw, ids, out=out, **act)  # type: ignore[arg-type]


def _run_fused(w13: torch.Tensor, w2: torch.Tensor, kw: dict[str, object], x: torch.Tensor,
               tw: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> object:  # fmt: skip
    return fused_experts(x, w13, w2, tw, ids, out=out, **kw)  # type: ignore[arg-type]


def bench_shape(
    shape: Shape, args: argparse.Namespace
) -> list[tuple[int, dict[str, float], float]]:
    """(M, {runner: us}, experts touched per call) for each M."""
    runners = runners_for(shape, args.layout, args.runners.split(","))
    rows = []
    for m in [int(b) for b in args.batches.split(",")]:
        batches = [
            random_routing(m, shape.hidden, shape.experts, shape.top_k, seed=1000 * m + r,
                           device="cuda")
            for r in range(args.rotate)
        ]  # fmt: skip
        touched = sum(int(torch.unique(ids).numel()) for _, _, ids in batches) / len(batches)
        times = {name: graph_us(run, batches) for name, run in runners.items()}
        rows.append((m, times, touched))
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="dsv4,k3")
    parser.add_argument("--batches", default=DEFAULT_BATCHES)
    parser.add_argument("--rotate", type=int, default=8, help="different inputs per graph")
    parser.add_argument("--layout", choices=("prepared", "plain"), default="prepared")
    parser.add_argument("--runners", default="mxfp4,bf16,fp8")
    parser.add_argument("--k3-experts", type=int, default=384)
    args = parser.parse_args()
    copy_bw = copy_bandwidth()
    table = []
    for key in args.shapes.split(","):
        shape = shapes(args.k3_experts)[key]
        table += [(key, shape, *row) for row in bench_shape(shape, args)]
        torch.cuda.empty_cache()

    print(
        f"\nMXFP4 layout: {args.layout}. Bandwidth on the 4-bit weights + scales of the experts "
        f"touched, against a {copy_bw / 1e9:.0f} GB/s device-to-device copy (read + written)."
    )
    print(
        "| shape | M | experts touched | mxfp4 us | bf16 us | fp8 us | mxfp4 vs bf16 | "
        "mxfp4 vs fp8 | mxfp4 GB/s | % of copy BW |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def fmt(v: float | None) -> str:
        return f"{v:.1f}" if v is not None else "-"

    for key, shape, m, times, touched in table:
        mx, bf, f8 = times.get("mxfp4"), times.get("bf16"), times.get("fp8")
        vs_bf = f"{bf / mx:.2f}x" if mx and bf else "-"
        vs_f8 = f"{f8 / mx:.2f}x" if mx and f8 else "-"
        gbs = touched * expert_bytes(shape) / (mx * 1e-6) if mx else None
        share = f"{gbs / copy_bw:.0%}" if gbs else "-"
        print(
            f"| {key} | {m} | {touched:.0f} | {fmt(mx)} | {fmt(bf)} | {fmt(f8)} | {vs_bf} | "
            f"{vs_f8} | {fmt(gbs / 1e9 if gbs else None)} | {share} |"
        )


if __name__ == "__main__":
    main()
