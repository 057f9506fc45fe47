"""Compile Triton kernels (the Hopper MoE ones of ``grouped_gemm_tma.py``, the KDA prefill ones)
for sm_90 without a GPU.

Triton's whole compiler (front end, TTGIR, LLVM, PTX, the bundled ptxas) runs on the CPU, so a
kernel the interpreter accepts but the compiler refuses (e.g. a global that is not a
``tl.constexpr``) fails here, and ``ptxas -v`` reports registers and spills per tile. Used by the
CPU kernel tests and ``scripts/compile_moe_tma_sm90.py``.

:func:`sm90_dry_run` goes one step further: inside it every ``@triton.jit`` launch made by real
host code (an op's entry point, a whole model forward on CPU tensors) is bound exactly as the GPU
launcher binds it (argument specialisation, constexprs, options), compiled for sm_90 and recorded
instead of run. The survey of which kernel fits the H200 at which dtype and shape
(``scripts/kernel_fit_survey.py``) and the footprint checks of the kernel-fit rules use it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    divisible_by_16: tuple[str, ...] = (),
) -> Any:
    """Any ``@triton.jit`` kernel for sm_90: ``signature`` types its runtime arguments by name
    (``"*fp32"``, ``"i32"``...), ``constexprs`` gives the rest their values. Arguments named in
    ``divisible_by_16`` get the divisibility a launch gives 16-aligned pointers and multiples of
    16 (what decides vectorised loads), so the compile matches a real launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    names = fn.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in divisible_by_16}
    src = ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
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


@dataclass(frozen=True)
class LaunchRecord:
    """One kernel launch seen by :func:`sm90_dry_run`: the kernel (``module.qualname``), its
    constexpr arguments, warps and stages, and what the sm_90 compiler made of it (``shared``
    bytes and, with ``registers=True``, registers a thread; ``error`` when it did not compile)."""

    kernel: str
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    shared: int | None
    registers: int | None = None
    spill_bytes: int | None = None
    error: str | None = None


@dataclass
class DryRun:
    """The launches recorded so far (each distinct compilation once, in launch order)."""

    records: list[LaunchRecord] = field(default_factory=list)
    registers: bool = False
    _seen: dict[tuple[str, str, str], LaunchRecord] = field(default_factory=dict)

    def kernel(self, suffix: str) -> list[LaunchRecord]:
        """The records of kernels whose name ends with ``suffix``."""
        return [r for r in self.records if r.kernel.endswith(suffix)]


def _compile_launch(
    jit_fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dry: DryRun
) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit_fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    name = f"{jit_fn.fn.__module__}.{jit_fn.fn.__qualname__}"
    key = (name, str(specialization), str(options))
    if key in dry._seen:
        return
    const_args = {
        p.name: v for p, v in zip(jit_fn.params, bound.values(), strict=True) if p.is_constexpr
    }
    warps, stages = int(options.num_warps), int(options.num_stages)
    try:
        kernel = triton.compile(
            ASTSource(jit_fn, signature, constexprs, attrs), target=target, options=options.__dict__
        )
    except Exception as exc:  # noqa: BLE001 - recorded: the survey reports what did not compile
        error = f"{type(exc).__name__}: {exc}"
        rec = LaunchRecord(name, const_args, warps, stages, None, error=error)
    else:
        usage = ptxas_usage(kernel) if dry.registers else None
        rec = LaunchRecord(
            name,
            const_args,
            warps,
            stages,
            int(kernel.metadata.shared),
            usage.registers if usage else None,
            usage.spill_bytes if usage else None,
        )
    dry._seen[key] = rec
    dry.records.append(rec)


def _import_kernel_modules() -> None:
    """Import every kernel module first: those that import ``interpreter_enabled`` by name must
    bind the real one, not the dry run's stand-in (which only ``triton_can_run`` may see)."""
    from sglang.kernels import ops

    for info in pkgutil.walk_packages(ops.__path__, ops.__name__ + "."):
        if not info.name.endswith("mhc_tilelang"):  # imports tilelang lazily; nothing to bind
            importlib.import_module(info.name)


@contextlib.contextmanager
def sm90_dry_run(*, registers: bool = False) -> Iterator[DryRun]:
    """Inside: Triton kernels launched on CPU tensors are compiled for sm_90 and recorded in the
    yielded :class:`DryRun`, never run (their outputs stay as allocated). The ops take their
    Triton paths as on a GPU (``triton_can_run`` is true), so the launches are the GPU's; host
    code that reads a kernel's output sees garbage, so drive entry points whose launch sequence
    does not depend on it. ``registers``: also run ``ptxas -v`` per kernel (slower)."""
    from triton.runtime.jit import JITFunction

    from sglang.kernels.ops import triton_dispatch

    if triton_dispatch.interpreter_enabled():
        raise RuntimeError("sm90_dry_run compiles the kernels: run it without TRITON_INTERPRET")
    _import_kernel_modules()
    dry = DryRun(registers=registers)
    real_run, real_interp = JITFunction.run, triton_dispatch.interpreter_enabled

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        del grid, warmup
        _compile_launch(self, args, kwargs, dry)

    JITFunction.run = record  # type: ignore[method-assign]
    # triton_can_run reads this name from its module: CPU tensors take the Triton paths, while
    # the ops' own interpreter switches (interpreter_enabled imported by name) stay off.
    triton_dispatch.interpreter_enabled = lambda: True  # type: ignore[assignment]
    try:
        yield dry
    finally:
        JITFunction.run = real_run  # type: ignore[method-assign]
        triton_dispatch.interpreter_enabled = real_interp  # type: ignore[assignment]
