"""mHC kernels per backend (torch reference, Triton, TileLang when it imports), DeepSeek V4 widths.

For each hidden size and token count, times ``mhc_pre`` (with the fused RMSNorm) and
``mhc_fused_post_pre`` (one sublayer's post and the next one's pre) under CUDA-graph replay, and
prints each backend's time, its achieved bandwidth (the residual stream read and written, once),
its largest difference from the torch reference, and the TileLang/Triton time ratio. What
``SGLANG_MHC_BACKEND=auto`` should prefer is decided from this table.

Usage: python scripts/bench_mhc.py [--hidden 4096,7168] [--tokens 1,8,64,512,4096]
       python scripts/bench_mhc.py --profile [--backend triton] [--hidden 7168] [--tokens 1]
(``--profile``: each kernel's own GPU time per call, from the torch profiler, beside the
graph-replay time, to show where a call's time goes.)
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from sglang.srt.environ import envs
from sglang.srt.layers import mhc
from sglang.srt.layers.mhc import MhcParams
from sglang.srt.utils.cuda_timing import graph_bench_us

HC = 4
MIX = MhcParams(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
NORM_EPS = 1e-6


def inputs(t: int, h: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(t * 131 + h)
    a = {
        "residual": (torch.randn(t, HC, h, generator=gen, device="cuda") * 2).bfloat16(),
        "x": torch.randn(t, h, generator=gen, device="cuda").bfloat16(),
        "fn": torch.randn((2 + HC) * HC, HC * h, generator=gen, device="cuda") * 0.01,
        "scale": torch.rand(3, generator=gen, device="cuda") * 1.5 + 0.25,
        "base": torch.randn((2 + HC) * HC, generator=gen, device="cuda") * 0.5,
        "norm_weight": torch.rand(h, generator=gen, device="cuda") + 0.5,
    }
    # The fused op's post/comb come from a real pre (torch reference) on the same inputs.
    with envs.SGLANG_MHC_BACKEND.override("torch"):
        mhc.reset_backend_selection()
        _, a["post"], a["comb"] = pre_outputs(a)
    return a


def pre_outputs(a: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(layer input, post, comb) of ``mhc_pre`` with the fused RMSNorm."""
    params = MIX.with_norm(a["norm_weight"], NORM_EPS)
    return mhc.mhc_pre(a["residual"], a["fn"], a["scale"], a["base"], params)


def fused_outputs(a: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(layer input, post, comb) of ``mhc_fused_post_pre`` (the new residual left out)."""
    _new_residual, layer_input, post, comb = mhc.mhc_fused_post_pre(
        a["x"],
        a["residual"],
        a["post"],
        a["comb"],
        a["fn"],
        a["scale"],
        a["base"],
        MIX.with_norm(a["norm_weight"], NORM_EPS),
    )
    return layer_input, post, comb


def run_pre(a: dict[str, torch.Tensor]) -> torch.Tensor:
    return pre_outputs(a)[0]


def run_fused(a: dict[str, torch.Tensor]) -> torch.Tensor:
    return fused_outputs(a)[0]


def stream_bytes(op: str, t: int, h: int) -> int:
    """bf16 bytes the op must move: pre reads the residual and writes the layer input; fused also
    reads the sublayer output and writes the new residual."""
    residual, row = t * HC * h * 2, t * h * 2
    return residual + row if op == "pre" else 2 * residual + 2 * row


def profile_rows(backend: str, hidden: list[int], tokens: list[int], calls: int = 50) -> None:
    """Per-kernel GPU time per call (eager calls under the torch profiler) against the graph-replay
    time of the whole call; the difference is launch gaps and idle time between the kernels."""
    from torch.profiler import ProfilerActivity, profile

    mhc.reset_backend_selection()
    with envs.SGLANG_MHC_BACKEND.override(backend):
        for h in hidden:
            for t in tokens:
                a = inputs(t, h)
                for op, run in {"pre": run_pre, "fused": run_fused}.items():
                    replay = graph_bench_us(lambda run=run, a=a: run(a))
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(calls):
                            run(a)
                        torch.cuda.synchronize()
                    kernels = [
                        e
                        for e in prof.key_averages()
                        if e.device_type == torch.autograd.DeviceType.CUDA
                    ]
                    total = sum(e.self_device_time_total for e in kernels) / calls
                    print(
                        f"\n{backend} {op} H={h} T={t}: graph replay {replay:.1f} us, "
                        f"kernels {total:.1f} us"
                    )
                    for e in sorted(kernels, key=lambda e: -e.self_device_time_total):
                        per_call = e.self_device_time_total / calls
                        print(f"  {per_call:8.2f} us  x{e.count / calls:.0f}  {e.key[:90]}")
    mhc.reset_backend_selection()


def available_backends() -> list[str]:
    error = mhc._tilelang_import_error()
    if error is not None:
        print(f"tilelang does not import ({error}): its columns are empty")
    return ["torch", "triton"] + ([] if error else ["tilelang"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", default="4096,7168")
    parser.add_argument("--tokens", default="1,8,64,512,4096")
    parser.add_argument("--profile", action="store_true", help="per-kernel times instead")
    parser.add_argument("--backend", default="triton", help="the backend --profile looks at")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch reference must be true fp32
    if args.profile:
        hidden = [int(h) for h in args.hidden.split(",")]
        profile_rows(args.backend, hidden, [int(t) for t in args.tokens.split(",")])
        return
    backends = available_backends()
    ops = {"pre": run_pre, "fused": run_fused}
    print(f"{torch.cuda.get_device_name()}, bf16 residual, hc={HC}, CUDA-graph replay")
    head = f"{'op':<5} {'H':>5} {'T':>5}"
    for b in backends:
        head += f" {b + ' us':>11} {b + ' GB/s':>13}"
    print(head + f" {'max|tl-ref|':>11} {'max|tr-ref|':>11} {'tilelang/triton':>15}", flush=True)
    hidden = [int(h) for h in args.hidden.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    for h, t in tqdm([(h, t) for h in hidden for t in tokens], desc="mHC"):
        a = inputs(t, h)
        for op, run in ops.items():
            times: dict[str, float] = {}
            errs: dict[str, float] = {}
            want = None
            for backend in backends:
                mhc.reset_backend_selection()
                with envs.SGLANG_MHC_BACKEND.override(backend):
                    got = run(a).float()
                    if want is None:
                        want = got
                    errs[backend] = float((got - want).abs().max())
                    times[backend] = graph_bench_us(lambda run=run, a=a: run(a))
            nbytes = stream_bytes(op, t, h)
            line = f"{op:<5} {h:>5} {t:>5}"
            for b in backends:
                line += f" {times[b]:>11.1f} {nbytes / times[b] / 1e3:>13.0f}"
            tl_err = f"{errs['tilelang']:.1e}" if "tilelang" in errs else "-"
            ratio = f"{times['tilelang'] / times['triton']:.2f}x" if "tilelang" in times else "-"
            tqdm.write(line + f" {tl_err:>11} {errs['triton']:>11.1e} {ratio:>15}")
    mhc.reset_backend_selection()


if __name__ == "__main__":
    main()
