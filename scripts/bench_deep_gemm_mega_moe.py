"""DeepGEMM's SM90 MegaMoE (``fp8_mega_moe``) against our Triton MegaMoE and the two-launch Triton
fused MoE, at the DeepSeek V4 expert shape in FP8, on one H200; and the reserve's cost.

For each M: the three times under CUDA-graph replay (each path's own quantisation, dispatch and
combine included; DeepGEMM's through the engine's ``run_mega_routed_experts``, so pre-dispatch
into the cached buffer plus the kernel on the SM budget), the ratios, DeepGEMM's relative
difference from the two-launch path, and DeepGEMM's time at 132 SMs (reserve 0) against the
default 130 (reserve 2).

Usage: python scripts/bench_deep_gemm_mega_moe.py [--batches 1,2,4,...,512]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton
from tqdm import tqdm

from bench_mega_moe import moe_args, rel_err
from bench_moe import SHAPES, make_batch, make_weights
from sglang.kernels.ops.moe.fused_moe import fused_experts
from sglang.kernels.ops.moe.mega_moe_triton import mega_fused_experts
from sglang.srt.environ import envs
from sglang.srt.layers.deep_gemm_adapter import deep_gemm_status
from sglang.srt.layers.moe.mega_moe import MegaMoEParams, run_mega_routed_experts
from sglang.srt.layers.moe.mega_moe_weights import build_mega_moe_experts_weights
from sglang.srt.layers.moe.sm_budget import mega_moe_sm_budget

RESERVE = envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512")
    args = parser.parse_args()
    status = deep_gemm_status()
    if not status.usable:
        raise SystemExit(f"DeepGEMM is unusable here: {status.reason}")
    dg = status.module
    device = torch.device("cuda")
    shape = SHAPES["dsv4"]
    limit = 10.0
    w = make_weights(shape, True, device)
    mega = build_mega_moe_experts_weights(dg, w.w13, w.w2, w.w13_scale, w.w2_scale)
    params = MegaMoEParams(shape.experts, shape.top_k, shape.hidden, shape.inter, "swiglu", limit)
    budget = (
        mega_moe_sm_budget(device) or torch.cuda.get_device_properties(device).multi_processor_count
    )
    rows = []
    for m in tqdm([int(b) for b in args.batches.split(",")], desc="M"):
        x, topk = make_batch(shape, m, device)
        kw = moe_args(shape, w, x, topk)

        deep_gemm = partial(
            run_mega_routed_experts,
            dg,
            None,
            x,
            topk.topk_ids,
            topk.topk_weights,
            mega[0],
            mega[1],
            params,
            device=device,
        )

        two = fused_experts(**kw)
        err = rel_err(deep_gemm(), two)  # also makes the buffer and compiles, outside the graphs
        t_two = triton.testing.do_bench_cudagraph(partial(fused_experts, **kw), rep=200)
        out = torch.empty_like(x)
        t_ours = triton.testing.do_bench_cudagraph(
            partial(mega_fused_experts, **kw, num_sms=budget, out=out), rep=200
        )
        t_dg = triton.testing.do_bench_cudagraph(deep_gemm, rep=200)
        with RESERVE.override(0):
            deep_gemm()
            t_dg_full = triton.testing.do_bench_cudagraph(deep_gemm, rep=200)
        rows.append((m, err, t_two * 1e3, t_ours * 1e3, t_dg * 1e3, t_dg_full * 1e3))
    print(
        f"\nDSv4 experts (E={shape.experts} top-{shape.top_k} H={shape.hidden} I={shape.inter}), "
        "FP8 128x128, "
        f"SwiGLU clamp {limit}; DeepGEMM {status.version}; budget {budget} SMs"
    )
    print(
        "| M | two-launch us | our MegaMoE us | DeepGEMM MegaMoE us | two/DG | ours/DG | DG rel "
        "diff | DG at 132 SMs us | 130 vs 132 |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m, err, t_two, t_ours, t_dg, t_full in rows:
        print(
            f"| {m} | {t_two:.1f} | {t_ours:.1f} | {t_dg:.1f} | {t_two / t_dg:.2f} | "
            f"{t_ours / t_dg:.2f} | "
            f"{err:.3f} | {t_full:.1f} | {t_dg / t_full - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()
