"""Our Triton MegaMoE (one persistent launch) against the two-launch Triton fused MoE, on one GPU.

Three tables:
1. correctness and speed: for each shape, dtype and batch M, the relative error of both Triton
   paths against the torch runner (outputs poisoned with NaN first, so any row left unwritten
   shows), and their times under CUDA-graph replay (align and quantisation included in both),
   the ratio, and the MegaMoE's fraction of the read-bandwidth roofline (weights touched, once);
2. the cost of the default reserve: MegaMoE time on the 130-SM budget against the full 132;
3. robustness: with a side-stream kernel holding 1, 2 and 8 whole SMs for longer than the call,
   N launches each on the default budget (outputs compared bit for bit with an undisturbed run,
   status checked), and the forced whole-grid barrier variant on a full grid and on the budget,
   which must give the bounded-wait error (not a hang) where not all CTAs can be resident.

With ``--sweep M,M,...`` it prints only a tuning table instead: each variant in ``SWEEP`` of the
shipped per-M tile config, its time and speed-up, and whether its output equals the shipped
config's bit for bit (the variants change scheduling, not the maths).

Usage: python scripts/bench_mega_moe.py [--shapes dsv4,k3] [--dtypes bf16,fp8]
       [--batches 1,2,4,8,16,32,64,128,256,512] [--launches 1000] [--skip-robustness]
       python scripts/bench_mega_moe.py --sweep 1,8,32,128 [--shapes dsv4] [--dtypes fp8]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
import triton
from tqdm import tqdm

from bench_moe import SHAPES, Shape, floor_terms, make_batch, make_weights
from sglang.kernels.ops.grid_barrier import resident_ctas_per_sm
from sglang.kernels.ops.moe.fused_moe import fused_experts, fused_experts_torch
from sglang.kernels.ops.moe.mega_moe_triton import (
    MegaMoEConfig,
    MegaMoELaunch,
    MegaMoEWaitTimeout,
    get_mega_config,
    mega_fused_experts,
)
from sglang.srt.environ import envs
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.sm_budget import mega_moe_sm_budget
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.test.sm_holder import cupy_available, hold_sms

READ_BW = 4.19e12  # pure-read streaming rate measured on these H200s (performance_targets.md)
SWIGLU_LIMIT = 10.0


def limit_of(shape: Shape) -> float | None:
    return SWIGLU_LIMIT if shape.activation == "swiglu" else None


def moe_args(shape: Shape, w: ExpertWeights, x: torch.Tensor, topk: TopKOutput) -> dict:
    return {
        "hidden": x,
        "w13": w.w13,
        "w2": w.w2,
        "topk_weights": topk.topk_weights,
        "topk_ids": topk.topk_ids,
        "activation": shape.activation,
        "swiglu_limit": limit_of(shape),
        "w13_scale": w.w13_scale,
        "w2_scale": w.w2_scale,
        "block_shape": (128, 128) if w.w13_scale is not None else None,
    }


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def speed_rows(
    shape_key: str, dtype: str, batches: list[int], budget: int, device: torch.device
) -> list[tuple]:
    shape = SHAPES[shape_key]
    fp8 = dtype == "fp8"
    w = make_weights(shape, fp8, device)
    rows = []
    for m in tqdm(batches, desc=f"{shape_key} {dtype}"):
        x, topk = make_batch(shape, m, device)
        args = moe_args(shape, w, x, topk)
        want = fused_experts_torch(**args)
        two = fused_experts(**args)
        out = torch.full_like(x, float("nan"))
        info: list[MegaMoELaunch] = []
        mega_fused_experts(**args, num_sms=budget, out=out, launch_info=info)
        info[-1].check()
        covered = bool(torch.isfinite(out).all())
        err_mega, err_two = rel_err(out, want), rel_err(two, want)
        t_two = triton.testing.do_bench_cudagraph(partial(fused_experts, **args), rep=200)
        t_mega = triton.testing.do_bench_cudagraph(
            partial(mega_fused_experts, **args, num_sms=budget, out=out), rep=200
        )
        info[-1].check()
        nbytes, _ = floor_terms(shape, m, topk, fp8)
        roof = nbytes / READ_BW * 1e3
        rows.append(
            (
                shape_key,
                dtype,
                m,
                covered,
                err_two,
                err_mega,
                t_two * 1e3,
                t_mega * 1e3,
                t_two / t_mega,
                roof / t_mega,
            )
        )
    del w
    torch.cuda.empty_cache()
    return rows


# Variants of the shipped per-M config (get_mega_config) at decode sizes.
SWEEP: dict[str, Callable[[MegaMoEConfig], MegaMoEConfig]] = {
    "shipped": lambda c: c,
    "1 fewer stage": lambda c: replace(c, num_stages=c.num_stages - 1),
    "1 more stage": lambda c: replace(c, num_stages=c.num_stages + 1),
    "n2 tile x2": lambda c: replace(c, block_n2=c.block_n2 * 2),
    "1 fewer CTA/SM": lambda c: replace(c, ctas_per_sm=max(1, c.ctas_per_sm - 1)),
    "1 more CTA/SM": lambda c: replace(c, ctas_per_sm=c.ctas_per_sm + 1),
}


def sweep_rows(
    shape_keys: list[str], batches: list[int], dtypes: list[str], device: torch.device, budget: int
) -> list[tuple]:
    """Variants of the shipped tiles at decode sizes, same run; each variant's output is compared
    bit for bit with the shipped config's (the variants change scheduling, not the maths)."""
    rows = []
    for shape_key in shape_keys:
        shape = SHAPES[shape_key]
        for dtype in dtypes:
            w = make_weights(shape, dtype == "fp8", device)
            for m in tqdm(batches, desc=f"sweep {shape_key} {dtype}"):
                x, topk = make_batch(shape, m, device)
                args = moe_args(shape, w, x, topk)
                t_two = triton.testing.do_bench_cudagraph(partial(fused_experts, **args), rep=100)
                shipped = get_mega_config(m, shape.experts, shape.top_k, dtype == "fp8")
                want = mega_fused_experts(**args, num_sms=budget, config=shipped)
                for name, make in SWEEP.items():
                    cfg = make(shipped)
                    out = torch.full_like(x, float("nan"))
                    info: list[MegaMoELaunch] = []
                    mega_fused_experts(
                        **args, num_sms=budget, out=out, config=cfg, launch_info=info
                    )
                    info[-1].check()
                    same = torch.equal(out, want)
                    t = triton.testing.do_bench_cudagraph(
                        partial(mega_fused_experts, **args, num_sms=budget, out=out, config=cfg),
                        rep=100,
                    )
                    rows.append((shape_key, dtype, m, name, same, t_two * 1e3, t * 1e3, t_two / t))
            del w
            torch.cuda.empty_cache()
    return rows


def budget_rows(
    batches: list[int], device: torch.device, physical: int, budget: int
) -> list[tuple]:
    rows = []
    for dtype in ("bf16", "fp8"):
        shape = SHAPES["dsv4"]
        w = make_weights(shape, dtype == "fp8", device)
        for m in batches:
            x, topk = make_batch(shape, m, device)
            args = moe_args(shape, w, x, topk)
            out = torch.empty_like(x)
            t_full = triton.testing.do_bench_cudagraph(
                partial(mega_fused_experts, **args, num_sms=physical, out=out), rep=300
            )
            t_budget = triton.testing.do_bench_cudagraph(
                partial(mega_fused_experts, **args, num_sms=budget, out=out), rep=300
            )
            rows.append((dtype, m, t_full * 1e3, t_budget * 1e3, t_budget / t_full - 1))
        del w
        torch.cuda.empty_cache()
    return rows


def robustness_rows(launches: int, device: torch.device, physical: int, budget: int) -> list[tuple]:
    shape = SHAPES["dsv4"]
    w = make_weights(shape, False, device)
    x, topk = make_batch(shape, 8, device)
    args = moe_args(shape, w, x, topk)
    info: list[MegaMoELaunch] = []
    want = mega_fused_experts(**args, num_sms=budget, launch_info=info)
    info[-1].check()
    side = torch.cuda.Stream(device)
    rows = []
    for held in (1, 2, 8):
        mismatches = timeouts = 0
        for _ in tqdm(range(launches), desc=f"{held} SMs held"):
            hold_sms(held, 3.0, side, device)
            got = mega_fused_experts(**args, num_sms=budget, launch_info=info)
            try:
                info[-1].check()
            except MegaMoEWaitTimeout:
                timeouts += 1
                continue
            mismatches += int(not torch.equal(got, want))
        torch.cuda.synchronize(device)
        rows.append(
            (f"tile queue, budget {budget}", info[-1].grid, held, launches, timeouts, mismatches)
        )

    # Forced whole-grid barrier: a grid of every CTA slot cannot be resident beside a held SM.
    compiled = info[-1].compiled
    per_sm = resident_ctas_per_sm(
        int(compiled.n_regs),
        int(compiled.metadata.shared),
        compiled.metadata.num_warps,
        torch.cuda.get_device_properties(device),
    )
    trials = max(10, launches // 50)
    message = ""
    for grid_sms, held in ((physical, 0), (physical, 1), (budget, 1), (budget, 2)):
        grid = grid_sms * per_sm
        timeouts = mismatches = 0
        for _ in range(trials):
            if held:
                hold_sms(held, 200.0, side, device)
            got = mega_fused_experts(
                **args,
                num_sms=budget,
                grid=grid,
                whole_grid_sync=True,
                timeout_ms=50.0,
                launch_info=info,
            )
            try:
                info[-1].check()
            except MegaMoEWaitTimeout as err:
                timeouts += 1
                message = str(err)
                continue
            mismatches += int(not torch.equal(got, want))
            torch.cuda.synchronize(device)
        rows.append(
            (
                f"whole-grid barrier, {grid_sms} SMs x {per_sm}",
                grid,
                held,
                trials,
                timeouts,
                mismatches,
            )
        )
    torch.cuda.synchronize(device)
    if any(r[4] for r in rows):
        print(f"\nexample bounded-wait error: {message}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="dsv4,k3")
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512")
    parser.add_argument("--budget-batches", default="1,8,32,128")
    parser.add_argument("--launches", type=int, default=1000)
    parser.add_argument("--skip-robustness", action="store_true")
    parser.add_argument(
        "--sweep", default="", help="batches for the tile/occupancy sweep only, e.g. 1,8,32,128"
    )
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    physical = torch.cuda.get_device_properties(device).multi_processor_count
    budget = mega_moe_sm_budget(device) or physical
    print(
        f"{torch.cuda.get_device_name(device)}: {physical} SMs; MegaMoE budget {budget} "
        f"(SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS={envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.get()})"
    )
    if args.sweep:
        batches = [int(b) for b in args.sweep.split(",")]
        srows = sweep_rows(args.shapes.split(","), batches, args.dtypes.split(","), device, budget)
        print(
            f"\n{'shape':<5} {'dtype':<5} {'M':>4} {'variant':<24} {'same':>5} {'2-launch us':>11} "
            f"{'mega us':>8} {'speedup':>7}"
        )
        for sk, d, m, name, same, t2, tm, ratio in srows:
            print(
                f"{sk:<5} {d:<5} {m:>4} {name:<24} {same!s:>5} {t2:>11.1f} {tm:>8.1f} "
                f"{ratio:>6.2f}x"
            )
        return
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for shape_key in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            rows += speed_rows(shape_key, dtype, batches, budget, device)
    print(
        f"\n{'shape':<5} {'dtype':<5} {'M':>4} {'covered':>7} {'err 2-launch':>12} {'err mega':>9} "
        f"{'2-launch us':>11} {'mega us':>8} {'speedup':>7} {'mega/roof':>9}"
    )
    for s, d, m, cov, e2, em, t2, tm, ratio, frac in rows:
        print(
            f"{s:<5} {d:<5} {m:>4} {cov!s:>7} {e2:>12.2e} {em:>9.2e} {t2:>11.1f} {tm:>8.1f} "
            f"{ratio:>6.2f}x {frac:>8.0%}"
        )

    if args.budget_batches:
        brows = budget_rows(
            [int(b) for b in args.budget_batches.split(",")], device, physical, budget
        )
        print(
            f"\n{'dtype':<5} {'M':>4} {f'{physical} SMs us':>11} {f'{budget} SMs us':>11} "
            f"{'cost':>7}"
        )
        for d, m, tf, tb, cost in brows:
            print(f"{d:<5} {m:>4} {tf:>11.1f} {tb:>11.1f} {cost:>+7.1%}")

    if args.skip_robustness or not cupy_available():
        print(
            "\nrobustness: skipped"
            + ("" if args.skip_robustness else " (CuPy missing: no SM holder)")
        )
        return
    rrows = robustness_rows(args.launches, device, physical, budget)
    print(
        f"\n{'design':<34} {'grid':>5} {'held SMs':>8} {'launches':>8} {'timeouts':>8} {'wrong':>5}"
    )
    for name, grid, held, n, to, bad in rrows:
        print(f"{name:<26} {grid:>5} {held:>8} {n:>8} {to:>8} {bad:>5}")


if __name__ == "__main__":
    main()
