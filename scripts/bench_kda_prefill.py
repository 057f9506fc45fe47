"""The KDA chunked prefill core (the delta rule over one fresh prompt) on one GPU: the Triton
kernels (``kernels/ops/kda/chunk_prefill.py``) in each dot precision against the torch chunked
form (``kda_chunk.py``, the reference), and against the HBM roofline.

Inputs as the layer hands them over: fp32 q (normed, scaled), k (normed), v, g (safe gate, bound
-5) and beta, a random fp32 state, heads of 128. ``--heads`` lists per-rank head counts (K3 has 96:
TP 1 and TP 8 are 96 and 12). The roofline reads every input once and writes the output and the
state: ``4 * T * H * (3K + V + 1) + 4 * T * H * V + 8 * H * K * V`` bytes at ``--hbm-tbps``.
``err`` is the largest difference from the torch form over its largest entry (both fp32).

Usage: python scripts/bench_kda_prefill.py [--tokens 1024,8192] [--heads 96,12]
       [--precisions tf32x3,ieee,tf32] [--hbm-tbps 4.8]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from sglang.kernels.ops.kda.chunk_prefill import kda_chunk_prefill_
from sglang.srt.layers.attention.kda_chunk import kda_chunked
from sglang.srt.utils.cuda_timing import median_cuda_ms
from sglang.test.kda_prefill_checks import prefill_inputs


def kernel_breakdown(run: partial) -> str:
    """Each launch's GPU time in one run (torch.profiler), e.g. ``intra 1.20 ms``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    parts = [
        f"{e.key.removeprefix('_chunk_').removesuffix('_kernel')} {e.device_time_total / 1e3:.2f}"
        for e in prof.key_averages()
        if e.key.startswith("_chunk_")
    ]
    return ", ".join(parts) + " ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="1024,8192")
    parser.add_argument("--heads", default="96,12")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--precisions", default="tf32x3,ieee,tf32")
    parser.add_argument("--hbm-tbps", type=float, default=4.8)
    parser.add_argument("--block-v", default="64", help="comma list of V columns a program")
    parser.add_argument("--warps", default="4", help="comma list of num_warps")
    parser.add_argument("--intra-warps", default="4", help="comma list of the intra kernel's")
    args = parser.parse_args()
    d = args.head_dim
    print(f"\nKDA chunked prefill core, heads of {d}, fp32 in/out, {torch.cuda.get_device_name()}")
    print(
        f"{'T':>6} {'H':>4} {'path':<26} {'ms':>9} {'torch/this':>10} {'of HBM roof':>11} "
        f"{'err':>9}"
    )
    gen = torch.Generator("cuda").manual_seed(0)
    for t in (int(x) for x in args.tokens.split(",")):
        for h in (int(x) for x in args.heads.split(",")):
            x = prefill_inputs(t, h, d, d, "mixed", gen, "cuda")
            qkvgb = [x[n] for n in ("q", "k", "v", "g", "beta")]
            roof_ms = (4 * t * h * (4 * d + 1) + 4 * t * h * d + 8 * h * d * d) / (
                args.hbm_tbps * 1e9
            )
            want, _ = kda_chunked(*qkvgb, x["state"])
            torch_ms = median_cuda_ms(partial(kda_chunked, *qkvgb, x["state"]), repeats=3)
            print(f"{t:>6} {h:>4} {'torch':<26} {torch_ms:>9.3f} {1.0:>10.2f} "
                  f"{roof_ms / torch_ms:>11.1%} {0.0:>9.1e}")  # fmt: skip
            out = torch.empty(t, h, d, device="cuda")
            s_out = torch.empty_like(x["state"])
            for prec in args.precisions.split(","):
                sweep = [
                    (int(b), int(w), int(iw))
                    for b in args.block_v.split(",")
                    for w in args.warps.split(",")
                    for iw in args.intra_warps.split(",")
                ]
                for bv, warps, intra_warps in sweep:
                    run = partial(
                        kda_chunk_prefill_, *qkvgb, x["state"], out, s_out,
                        precision=prec, block_v=bv, num_warps=warps, intra_warps=intra_warps,
                    )  # fmt: skip
                    ms = median_cuda_ms(run)
                    err = float((out - want).abs().max() / want.abs().max())
                    label = f"{prec} bv{bv} w{warps} iw{intra_warps}"
                    parts = kernel_breakdown(run)
                    print(f"{t:>6} {h:>4} {label:<26} {ms:>9.3f} {torch_ms / ms:>10.2f} "
                          f"{roof_ms / ms:>11.1%} {err:>9.1e}   {parts}")  # fmt: skip


if __name__ == "__main__":
    main()
