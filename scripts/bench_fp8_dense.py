"""Every dense GEMM of a DeepSeek V4-Flash layer (one rank) in block FP8 against bf16, one table.

GEMMs (N x K): ``wq_a`` 1024x4096, ``wkv`` 512x4096, ``wq_b`` 32768x1024, the indexer's ``wq_b``
8192x1024, ``wo_a`` (grouped: 8 groups of 1024x4096), ``wo_b`` 4096x8192, the shared expert's
``w1``/``w3`` 2048x4096 and ``w2`` 4096x2048, at M = 1, 16, 64, 256, 2048, 8192 rows.

Columns, microseconds under CUDA-graph replay (``triton.testing.do_bench_cudagraph``):
- ``triton``: our block-FP8 GEMM (``kernels/ops/gemm``, the table's tile) on pre-quantised rows;
  ``+q``: the same with the activation quantiser launch, as a layer runs it;
- ``deep_gemm``: DeepGEMM's ``fp8_gemm_nt`` (when it is usable; its ``+q`` likewise; the grouped
  ``wo_a`` has no DeepGEMM path here, so its column is empty);
- ``bf16``: ``torch.mm`` on the bf16 weight (for ``wo_a``, the ``einsum`` the bf16 layer runs);
- ``x bf16``: bf16 time / FP8 time with the quantiser (> 1: FP8 is faster), Triton and DeepGEMM;
- ``%HBM`` (M <= 64): bytes the GEMM moves (FP8 weight + its scales + quantised rows + their
  scales, read; the bf16 output, written) / its time, over the copy bandwidth measured in this
  run (a device-to-device copy of 2 GiB: bytes read + written / time), best FP8 path.

``--fused`` (default on) adds the producers that quantise for the next FP8 GEMM against their
unfused chains: the q norm (RMSNorm over 1024 then quant, vs ``norm_rope`` + quantiser), the shared
expert's SwiGLU (vs ``act_and_mul`` + quantiser), ``wo_a``'s quantising epilogue (vs the grouped
GEMM + quantiser), and split-K ``wq_a`` + the q norm in one reduction at decode sizes.

Usage: python scripts/bench_fp8_dense.py [--batches 1,16,64,256,2048,8192] [--gemms wq_a,wo_b]
       [--no-fused] [--rep 100]
(DeepGEMM JIT-compiles a kernel per shape on first use, 3-5 s each; split a run by ``--batches``
to keep each well under five minutes on a fresh machine.)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from sglang.kernels.ops.gemm.fp8_block_gemm import (
    fp8_block_gemm,
    fp8_gemm_partials,
    fp8_gemm_quant_out,
    fp8_grouped_gemm,
    quant_activation_fp8,
)
from sglang.kernels.ops.gemm.fp8_gemm_config import choose_config
from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8, per_token_group_quant_fp8
from sglang.kernels.ops.quant.fused_quant import gated_act_quant_fp8, rms_norm_quant_fp8
from sglang.srt.layers.activation import act_and_mul
from sglang.srt.layers.deep_gemm_adapter import deep_gemm_status
from sglang.srt.layers.norm_rope import RowNorm, norm_rope
from sglang.srt.layers.quantization.fp8_linear import Fp8Activation, deep_gemm_fp8_gemm
from sglang.srt.utils.cuda_timing import graph_bench_us


@dataclass(frozen=True)
class Gemm:
    name: str
    n: int  # rows of the weight (per group)
    k: int
    groups: int = 1


GEMMS = (
    Gemm("wq_a", 1024, 4096),
    Gemm("wkv", 512, 4096),
    Gemm("wq_b", 32768, 1024),
    Gemm("indexer.wq_b", 8192, 1024),
    Gemm("wo_a", 1024, 4096, groups=8),
    Gemm("wo_b", 4096, 8192),
    Gemm("shared.w1", 2048, 4096),
    Gemm("shared.w3", 2048, 4096),
    Gemm("shared.w2", 4096, 2048),
)
DECODE_MAX_M = 64


def copy_bytes_per_s() -> float:
    """Device-to-device copy of 2 GiB: (bytes read + bytes written) / time."""
    n = 2**30
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=200)
    return 2 * 2 * n / (ms * 1e-3)


def _operands(g: Gemm, m: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(m + g.n)
    shape = (m, g.k) if g.groups == 1 else (m, g.groups, g.k)
    x = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(g.groups * g.n, g.k, device="cuda", generator=gen) * 0.02).bfloat16()
    w_q, w_s = block_quant_weight_fp8(w)
    a_q, a_s = quant_activation_fp8(x.reshape(-1, g.k))
    if g.groups > 1:
        a_q, a_s = a_q.view(m, g.groups, -1), a_s.view(m, g.groups, -1)
    return {"x": x, "w": w, "w_q": w_q, "w_s": w_s, "a_q": a_q, "a_s": a_s}


def _quantise(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    if groups == 1:
        return quant_activation_fp8(x)
    m, g, k = x.shape
    q, s = quant_activation_fp8(x.reshape(m * g, k))
    return q.view(m, g, -1), s.view(m, g, -1)


def moved_bytes(g: Gemm, m: int) -> int:
    """FP8 weight + scales + quantised rows + their scales (read) + bf16 output (written)."""
    n, k = g.groups * g.n, g.k
    weight = n * k + 4 * triton.cdiv(n, 128) * triton.cdiv(k, 128)
    rows = g.groups * m * (k + 4 * triton.cdiv(k, 128))
    return weight + rows + 2 * m * n


def bench_gemm(g: Gemm, m: int, rep: int, dg: object | None) -> dict[str, float | None]:
    t = _operands(g, m)
    grouped = g.groups > 1
    run = fp8_grouped_gemm if grouped else fp8_block_gemm
    out: dict[str, float | None] = {}
    out["triton"] = graph_bench_us(lambda: run(t["a_q"], t["a_s"], t["w_q"], t["w_s"]), rep)
    out["triton+q"] = graph_bench_us(
        lambda: run(*_quantise(t["x"], g.groups), t["w_q"], t["w_s"]),
        rep,
    )
    out["deep_gemm"] = out["deep_gemm+q"] = None
    if dg is not None and not grouped:
        act = Fp8Activation(t["a_q"], t["a_s"])
        bf16 = torch.bfloat16
        out["deep_gemm"] = graph_bench_us(
            lambda: deep_gemm_fp8_gemm(dg, act, t["w_q"], t["w_s"], bf16), rep
        )
        out["deep_gemm+q"] = graph_bench_us(
            lambda: deep_gemm_fp8_gemm(
                dg, Fp8Activation(*quant_activation_fp8(t["x"])), t["w_q"], t["w_s"], bf16
            ),
            rep,
        )
    if grouped:
        w3 = t["w"].view(g.groups, g.n, g.k)
        out["bf16"] = graph_bench_us(lambda: torch.einsum("tgd,grd->tgr", t["x"], w3), rep)
    else:
        wt = t["w"].t()
        out["bf16"] = graph_bench_us(lambda: torch.mm(t["x"], wt), rep)
    return out


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def gemm_table(batches: list[int], gemms: list[Gemm], rep: int, copy_bw: float) -> None:
    status = deep_gemm_status()
    dg = status.module if status.usable else None
    print(f"DeepGEMM: {'usable' if dg is not None else 'unusable'} ({status.reason})")
    print(
        "\n| GEMM | M | tile | triton | +q | deep_gemm | +q | bf16 | x bf16 triton | "
        "x bf16 deep_gemm | %HBM |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for g in gemms:
        for m in batches:
            r = bench_gemm(g, m, rep, dg)
            cfg = choose_config(m, g.n, g.k, groups=g.groups)
            tile = f"{cfg.block_m}x{cfg.block_n}{'T' if cfg.swap_ab else ''}/{cfg.split_k}"
            best = min(v for k, v in r.items() if k in ("triton", "deep_gemm") and v is not None)
            hbm = moved_bytes(g, m) / (best * 1e-6) / copy_bw if m <= DECODE_MAX_M else None
            bf16 = r["bf16"]
            assert bf16 is not None and r["triton+q"] is not None
            dg_ratio = None if r["deep_gemm+q"] is None else bf16 / r["deep_gemm+q"]
            print(
                f"| {g.name} | {m} | {tile} | {_fmt(r['triton'])} | {_fmt(r['triton+q'])} | "
                f"{_fmt(r['deep_gemm'])} | {_fmt(r['deep_gemm+q'])} | {_fmt(bf16)} | "
                f"{bf16 / r['triton+q']:.2f} | {_fmt(dg_ratio, '.2f')} | "
                f"{_fmt(None if hbm is None else 100 * hbm, '.0f')} |",
                flush=True,
            )


Case = tuple[str, Callable[[], object], Callable[[], object]]


def fused_cases(m: int) -> list[Case]:
    """(producer, unfused chain, fused launch) at ``m`` rows, DeepSeek V4-Flash widths."""
    eps = 1e-6
    gen = torch.Generator(device="cuda").manual_seed(m)
    q_lora = torch.randn(m, 1024, device="cuda", generator=gen).bfloat16()
    norm_w = torch.rand(1024, device="cuda", generator=gen) + 0.5
    gate_up = torch.randn(m, 4096, device="cuda", generator=gen).bfloat16()
    gate, up = gate_up[:, :2048].contiguous(), gate_up[:, 2048:].contiguous()
    o = _operands(Gemm("wo_a", 1024, 4096, groups=8), m)
    q = _operands(Gemm("wq_a", 1024, 4096), m)

    def quantise(x: torch.Tensor) -> object:
        return per_token_group_quant_fp8(x, 128, scale_mn_major=True)

    cases: list[Case] = [
        (
            "q norm + quant",
            lambda: quantise(norm_rope(q_lora, norm=RowNorm.weighted(norm_w, eps))),
            lambda: rms_norm_quant_fp8(q_lora, norm_w, eps),
        ),
        (
            "shared SwiGLU + quant",
            lambda: quantise(act_and_mul(gate_up, "swiglu", swiglu_limit=10.0)),
            lambda: gated_act_quant_fp8(gate, up, "swiglu", 10.0),
        ),
        (
            "wo_a epilogue quant",
            lambda: quantise(fp8_grouped_gemm(o["a_q"], o["a_s"], o["w_q"], o["w_s"])),
            lambda: fp8_gemm_quant_out(o["a_q"], o["a_s"], o["w_q"], o["w_s"]),
        ),
    ]
    if m <= DECODE_MAX_M:  # split-K wq_a: its reduction, the q norm and the quant in one launch
        cases.append(
            (
                "wq_a split-K + q norm + quant",
                lambda: rms_norm_quant_fp8(
                    fp8_block_gemm(q["a_q"], q["a_s"], q["w_q"], q["w_s"]), norm_w, eps
                ),
                lambda: rms_norm_quant_fp8(
                    fp8_gemm_partials(q["a_q"], q["a_s"], q["w_q"], q["w_s"]), norm_w, eps
                ),
            )
        )
    return cases


def fused_table(batches: list[int], rep: int) -> None:
    """Producers that write the next GEMM's FP8 input, against their unfused chains."""
    print("\n| producer | M | unfused us | fused us | unfused/fused |\n|---|---:|---:|---:|---:|")
    for m in batches:
        for name, unfused, fused in fused_cases(m):
            a, b = graph_bench_us(unfused, rep), graph_bench_us(fused, rep)
            print(f"| {name} | {m} | {a:.1f} | {b:.1f} | {a / b:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,16,64,256,2048,8192")
    parser.add_argument("--gemms", default=",".join(g.name for g in GEMMS))
    parser.add_argument("--no-fused", action="store_true")
    parser.add_argument("--rep", type=int, default=100, help="ms of replays a timing")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    names = args.gemms.split(",")
    unknown = set(names) - {g.name for g in GEMMS}
    if unknown:
        parser.error(f"unknown GEMM(s) {sorted(unknown)}; known: {[g.name for g in GEMMS]}")
    torch.cuda.init()
    copy_bw = copy_bytes_per_s()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; copy {copy_bw / 1e9:.0f} GB/s")
    gemm_table(batches, [g for g in GEMMS if g.name in names], args.rep, copy_bw)
    if not args.no_fused:
        fused_table(batches, args.rep)


if __name__ == "__main__":
    main()
