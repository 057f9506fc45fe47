"""Registers and spills of the Hopper MoE kernels per tile, compiled for sm_90 on this machine.

Runs Triton's compiler and its bundled ``ptxas -v`` (no GPU needed) for the tiles that decide
whether 128-row FP8 tiles fit: gathered against sorted activations, two accumulators against the
rescaled one. The installed Triton decides the numbers (the H200 runs 3.6; the CPU CI 3.9).

Usage: python scripts/compile_moe_tma_sm90.py
"""

from __future__ import annotations

import triton

from sglang.test.sm90_compile import TmaKernelSpec, compile_tma_kernel, ptxas_usage

S = TmaKernelSpec
CASES = [
    ("FP8 gate-up 64x128x128 (8 warps), two accumulators", S(True, True, 64, 128, 128, 8, 4)),
    ("FP8 gate-up 128x128x128 (8), rescaled", S(True, True, 128, 128, 128, 8, 3, rescale=True)),
    ("FP8 gate-up 128x128x128 (8), two accumulators", S(True, True, 128, 128, 128, 8, 3)),
    ("bf16 gate-up 128x128x64 (8)", S(True, False, 128, 128, 64, 8, 4)),
    ("FP8 down 128x128x128 (8), rescaled", S(False, True, 128, 128, 128, 8, 4, rescale=True)),
    ("FP8 down 128x256x128 (8), two accumulators", S(False, True, 128, 256, 128, 8, 3)),
]


def cell(spec: TmaKernelSpec) -> str:
    u = ptxas_usage(compile_tma_kernel(spec))
    return f"{u.registers} regs, {u.spill_bytes} B spilled"


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90a\n")
    print("| kernel, tile | gathered A | sorted A |\n|---|---|---|")
    for name, spec in CASES:
        gathered = cell(spec)
        sorted_a = (
            cell(TmaKernelSpec(**{**spec.__dict__, "sorted_a": True}))
            if spec.gate_up
            else ("(A is TMA already)")
        )
        print(f"| {name} | {gathered} | {sorted_a} |")


if __name__ == "__main__":
    main()
