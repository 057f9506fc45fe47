"""Compile Triton kernels (the Hopper MoE ones of ``grouped_gemm_tma.py``, the KDA prefill ones)
for sm_90 without a GPU.

Triton's whole compiler (front end, TTGIR, LLVM, PTX, the bundled ptxas) runs on the CPU, so a
kernel the interpreter accepts but the compiler refuses (e.g. a global that is not a
``tl.constexpr``) fails here, and ``ptxas -v`` reports registers and spills per tile. Used by the
CPU kernel tests and ``scripts/compile_moe_tma_sm90.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

import triton


@dataclass(frozen=True)
class TmaKernelSpec:
    """One TMA MoE kernel at one tile: ``gate_up`` or down, FP8 or bf16, the tile's flags."""

    gate_up: bool
    fp8: bool
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    rescale: bool = False
    paired: bool = False
    sorted_a: bool = False
    half_tiles: bool = False


@dataclass(frozen=True)
class Usage:
    registers: int
    spill_bytes: int
    shared_bytes: int


def _signature(spec: TmaKernelSpec) -> dict[str, str]:
    el = "fp8e4nv" if spec.fp8 else "bf16"
    a_tile = f"tensordesc<{el}[{spec.block_m}, {spec.block_k}]>"
    a_half = f"tensordesc<{el}[{spec.block_m // 2}, {spec.block_k}]>" if spec.half_tiles else a_tile
    w_block = (
        f"[2, {spec.block_n}, {spec.block_k}]"
        if spec.paired
        else (f"[{spec.block_n}, {spec.block_k}]")
    )
    w_desc = f"tensordesc<{el}{w_block}>"
    ids = {"sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "ntpp_ptr": "*i32"}
    if spec.gate_up:
        return {
            "a_ptr": a_tile if spec.sorted_a else f"*{el}",
            "a_half_ptr": a_half if spec.sorted_a else f"*{el}", "a_scale_ptr": "*fp32",
            "w_desc": w_desc, "w_scale_ptr": "*fp32", "out_ptr": f"*{el}",
            "out_scale_ptr": "*fp32", **ids, "num_slots": "i32", "inter": "i32",
            "k_dim": "i32", "top_k": "i32", "stride_am": "i32", "stride_asm": "i32",
            "stride_wse": "i32", "stride_wsn": "i32", "stride_om": "i32", "stride_osm": "i32",
            "limit": "fp32", "eps": "fp32",
        }  # fmt: skip
    return {
        "a_desc": a_tile, "a_half_desc": a_half, "a_scale_ptr": "*fp32", "w_desc": w_desc,
        "w_scale_ptr": "*fp32",
        "out_ptr": "*bf16", "topk_weights_ptr": "*fp32", **ids, "num_slots": "i32",
        "n_cols": "i32", "k_dim": "i32", "stride_asm": "i32", "stride_wse": "i32",
        "stride_wsn": "i32", "stride_om": "i32",
    }  # fmt: skip


def compile_tma_kernel(spec: TmaKernelSpec) -> Any:
    """The compiled kernel (``.asm`` has ``ptx`` and ``cubin``) for sm_90."""
    from sglang.kernels.ops.moe import grouped_gemm_tma as g

    fn = g._gate_up_tma_kernel if spec.gate_up else g._down_tma_kernel
    const: dict[str, Any] = {
        "SCALE_BLOCK": 128, "FP8": spec.fp8, "BLOCK_M": spec.block_m, "BLOCK_N": spec.block_n,
        "BLOCK_K": spec.block_k, "GROUP_M": 16, "NUM_PROGRAMS": 132, "WARP_SPECIALIZE": False,
        "RESCALE": spec.rescale, "HALF_TILES": spec.half_tiles,
    }  # fmt: skip
    if spec.gate_up:
        const.update(ACTIVATION=0, HAS_LIMIT=True, PAIRED=spec.paired, A_SORTED=spec.sorted_a)
    return compile_sm90(fn, _signature(spec), const, spec.num_warps, spec.num_stages)


def compile_sm90(
    fn: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int,
    num_stages: int,
    *,
    aligned: tuple[str, ...] = (),
) -> Any:
    """Any ``@triton.jit`` kernel for sm_90: ``signature`` types its runtime arguments by name
    (``"*fp32"``, ``"i32"``...), ``constexprs`` gives the rest their values. ``aligned`` names
    the arguments a launch passes divisible by 16 (16-byte aligned pointers, strides that are
    multiples of 16), which Triton's launcher specialises on: vector loads and the async-copy
    pipeline depend on it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    names = fn.arg_names
    src = ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in aligned},
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_usage(kernel: Any) -> Usage:
    """Registers and spill bytes from the bundled ptxas (``-v``) on the kernel's PTX."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # The newest bundled ptxas: Triton may emit a PTX version the older one refuses.
    ptxas = next(
        p
        for name in ("ptxas-blackwell", "ptxas")
        if os.path.isfile(p := os.path.join(bin_dir, name))
    )
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        args = [ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "k.o")]
        log = subprocess.run(args, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    if regs is None or spills is None:
        raise RuntimeError(f"no register report in ptxas -v output:\n{log}")
    return Usage(int(regs.group(1)), int(spills.group(1)), int(kernel.metadata.shared))
