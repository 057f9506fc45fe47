"""mHC pre / fused post+pre at prefill sizes: the split-over-H mix kernel (tf32x3) against the
bf16-MMA mix kernel (``mhc_mix_mma``), per tile config, under CUDA-graph replay.

Each row times the whole Triton call (mix kernel + finalize) with the mixes forced onto one path
(``mhc_triton.MMA_MIN_T``), and prints its time, the bytes the op must move over that time
(``bench_mhc.stream_bytes``; the finalize re-reads the residual, so the floor is lower than the
HBM rate), the split path's time over this one, and the largest differences of post / comb and
of the layer input from the torch backend (fp32 maths) on the same inputs. ``MMA_MIN_T`` is
chosen from this table.

Usage: python scripts/bench_mhc_mix.py [--hidden 4096,7168] [--tokens 256,512,1024,2048,8192]
       [--configs 128x32x8x3,128x64x8x2] [--fused-configs 128x32x8x2]
(a config is tokens x columns x warps x stages; the first of each is the default tile)
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from bench_mhc import fused_outputs, inputs, pre_outputs, run_fused, run_pre, stream_bytes, time_us
from sglang.kernels.ops.layernorm import mhc_mix_mma, mhc_triton
from sglang.kernels.ops.layernorm.mhc_mix_mma import MixMmaConfig
from sglang.srt.environ import envs
from sglang.srt.layers import mhc

NEVER = 1 << 62


def parse_configs(text: str) -> list[MixMmaConfig]:
    out = []
    for item in filter(None, text.split(",")):
        t, d, w, s = (int(v) for v in item.split("x"))
        out.append(MixMmaConfig(block_t=t, block_d=d, num_warps=w, num_stages=s))
    return out


OUTPUTS = {"pre": pre_outputs, "fused": fused_outputs}
RUNS = {"pre": run_pre, "fused": run_fused}


def reference(op: str, a: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(layer input, post, comb) of the torch backend (fp32 maths) on the same inputs."""
    with envs.SGLANG_MHC_BACKEND.override("torch"):
        mhc.reset_backend_selection()
        want = OUTPUTS[op](a)
    mhc.reset_backend_selection()
    return want


def errors(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> tuple[float, float]:
    """(max |post, comb - ref|, max |layer input - ref|)."""
    mix = max(float((g - w).abs().max()) for g, w in zip(got[1:], want[1:]))
    return mix, float((got[0].float() - want[0].float()).abs().max())


def timed(
    op: str, a: dict[str, torch.Tensor], min_t: int
) -> tuple[float, tuple[torch.Tensor, ...]]:
    mhc_triton.MMA_MIN_T = min_t
    got = OUTPUTS[op](a)
    return time_us(lambda: RUNS[op](a)), got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", default="4096,7168")
    parser.add_argument("--tokens", default="256,512,1024,2048,8192")
    parser.add_argument("--configs", default="128x32x8x3,128x64x8x2")
    parser.add_argument("--fused-configs", default="128x32x8x2")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch reference must be true fp32
    configs = {"pre": parse_configs(args.configs), "fused": parse_configs(args.fused_configs)}
    defaults = {"pre": mhc_mix_mma.PRE_CONFIG, "fused": mhc_mix_mma.FUSED_CONFIG}
    saved_min_t = mhc_triton.MMA_MIN_T
    hidden = [int(h) for h in args.hidden.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"{torch.cuda.get_device_name()}, bf16 residual, hc=4, CUDA-graph replay")
    print(
        f"{'op':<5} {'H':>5} {'T':>5} {'path':<22} {'us':>8} {'GB/s':>6} {'split/this':>10} "
        f"{'mix err':>8} {'y err':>8}"
    )
    mhc.reset_backend_selection()
    with envs.SGLANG_MHC_BACKEND.override("triton"):
        for h, t in tqdm([(h, t) for h in hidden for t in tokens], desc="mHC mix"):
            a = inputs(t, h)
            for op in ("pre", "fused"):
                want = reference(op, a)
                nbytes = stream_bytes(op, t, h)
                split_us, got = timed(op, a, NEVER)
                rows = [("split (tf32x3)", split_us, got)]
                for cfg in configs[op]:
                    setattr(mhc_mix_mma, "PRE_CONFIG" if op == "pre" else "FUSED_CONFIG", cfg)
                    name = f"mma {cfg.block_t}x{cfg.block_d} w{cfg.num_warps} s{cfg.num_stages}"
                    rows.append((name, *timed(op, a, 0)))
                setattr(mhc_mix_mma, "PRE_CONFIG" if op == "pre" else "FUSED_CONFIG", defaults[op])
                for name, us, got in rows:
                    mix_err, y_err = errors(got, want)
                    tqdm.write(
                        f"{op:<5} {h:>5} {t:>5} {name:<22} {us:>8.1f} {nbytes / us / 1e3:>6.0f} "
                        f"{split_us / us:>10.2f} {mix_err:>8.1e} {y_err:>8.1e}"
                    )
    mhc_triton.MMA_MIN_T = saved_min_t
    mhc.reset_backend_selection()


if __name__ == "__main__":
    main()
