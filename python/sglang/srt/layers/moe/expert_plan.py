"""How a MoE layer keeps and runs its routed experts: the one decision from the flags
(``--moe-runner-backend``, ``--moe-a2a-backend``, ``--dtype``), the checkpoint's expert format
and the device.

:func:`plan_experts` answers every combination, either with an :class:`ExpertPlan` (the format
and layout that stay resident, the conversion at load, DeepGEMM's MegaMoE kernel if it reads
them, what the runner runs) or with an :class:`ExpertPlanError` whose message names the flag to
change. Both answers come from the tables below, and nothing else in the engine decides them: the
loader converts as the plan says, ``check_env`` prints it, the tests feed it the facts of an H200,
a B200 and a CPU.

Residency, in words (first match):
1. bf16 checkpoints stay in the model dtype;
2. ``--moe-a2a-backend megamoe`` where DeepGEMM's MegaMoE kernel takes the layer keeps its layout
   as the only copy: Blackwell's ``fp8_fp4_mega_moe`` reads MXFP4, Hopper's ``fp8_mega_moe``
   reads FP8 (an FP8 checkpoint, or MXFP4 converted to FP8 at load, exactly where a block allows:
   ``quantization/mxfp4_to_fp8.py``; bf16 activations only); batches the kernel does not take
   read the experts they use from that copy;
3. ``--dtype float32`` (the exactness-check mode) dequantises MXFP4 to fp32 at load;
4. ``--moe-runner-backend deep_gemm`` with MXFP4 converts to FP8 (its grouped GEMMs are FP8/bf16);
5. otherwise the checkpoint's format stays: MXFP4 runs through the Triton W4A16 kernel
   (``triton``) or is dequantised expert by expert on use (``torch``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sglang.kernels.fit.decide import unfit_reason
from sglang.srt.layers.moe.expert_weights import ExpertLayout, ExpertWeights, WeightFormat
from sglang.srt.layers.moe.mega_moe import (
    MegaMoEParams,
    bf16_activations_only,
    mega_moe_kernel_name,
    mega_moe_layer_reason,
    mega_moe_max_tokens,
    mega_moe_shape_reason,
)
from sglang.srt.layers.moe.mega_moe_triton_backend import triton_mega_unavailable_reason
from sglang.srt.layers.moe.moe_runner.path_table import (
    MoeShape,
    dtype_key,
    mega_moe_measured_slower,
)

FP8_BLOCK = 128
_FIRST_DEEP_GEMM_ARCH = 90
_FIRST_BLACKWELL_ARCH = 100
# What each DeepGEMM MegaMoE kernel (``mega_moe_kernel_name``) reads.
MEGA_KERNEL_FORMAT = {"fp8_fp4_mega_moe": WeightFormat.MXFP4, "fp8_mega_moe": WeightFormat.FP8}


@dataclass(frozen=True)
class DeviceFacts:
    """What the decision needs of the device: ``kind`` "cuda" or "cpu", the compute capability
    (0 off CUDA) and whether DeepGEMM is usable. ``name`` is for messages."""

    name: str
    kind: str
    arch: int
    deep_gemm: bool


H200 = DeviceFacts("H200 (sm_90)", "cuda", 90, deep_gemm=True)
B200 = DeviceFacts("B200 (sm_100)", "cuda", 100, deep_gemm=True)
CPU = DeviceFacts("CPU", "cpu", 0, deep_gemm=False)


@dataclass(frozen=True)
class ExpertShape:
    """A layer's experts as the decision sees them: full sizes, this rank's intermediate slice,
    the activation and its clamp."""

    num_experts: int
    hidden: int
    intermediate: int
    local_intermediate: int
    top_k: int
    activation: str = "swiglu"
    swiglu_limit: float | None = None

    @property
    def mega_params(self) -> MegaMoEParams:
        return MegaMoEParams(
            self.num_experts,
            self.top_k,
            self.hidden,
            self.intermediate,
            self.activation,
            self.swiglu_limit,
        )

    @property
    def fp8_grid_fits(self) -> bool:
        """FP8 128x128 blocks tile this rank's experts with no block across gate and up."""
        return self.hidden % FP8_BLOCK == 0 and self.local_intermediate % FP8_BLOCK == 0


class Conversion(str, enum.Enum):
    NONE = "none"
    DEQUANTISE = "dequantise"  # MXFP4 -> the model dtype (fp32, exactness-check mode)
    MXFP4_TO_FP8 = "mxfp4_to_fp8"  # 128x128 blocks, exact where a block allows


@dataclass(frozen=True)
class ExpertPlan:
    runner: str  # the runner that runs (``auto`` resolved)
    a2a: str
    checkpoint: WeightFormat
    resident: WeightFormat  # bf16: unquantised, in ``dtype``
    dtype: torch.dtype
    layout: ExpertLayout
    conversion: Conversion
    mega_kernel: str | None  # DeepGEMM's MegaMoE kernel that reads the resident copy
    runner_path: str  # what the runner runs on these experts
    mega_reason: str | None = None  # why no MegaMoE kernel keeps them (--moe-a2a-backend megamoe)

    @property
    def is_mega(self) -> bool:
        return self.layout is ExpertLayout.MEGA

    def describe(self) -> str:
        held = self.resident.value
        if self.resident is WeightFormat.BF16:
            held = str(self.dtype).removeprefix("torch.")
        held += " in DeepGEMM's MegaMoE layout" if self.is_mega else ""
        conv = {
            Conversion.NONE: "",
            Conversion.DEQUANTISE: ", dequantised at load",
            Conversion.MXFP4_TO_FP8: ", converted from MXFP4 at load",
        }[self.conversion]
        kernel = f"; MegaMoE kernel {self.mega_kernel}" if self.mega_kernel else ""
        return (
            f"{self.checkpoint.value} experts kept {held}{conv}{kernel}; "
            f"--moe-runner-backend {self.runner}: {self.runner_path}"
        )


class ExpertPlanError(ValueError):
    """A flag combination that cannot run these experts here; the message names the flag."""


@dataclass(frozen=True)
class Case:
    """One question: the flags (runner resolved), the format, the model dtype, the device and
    the layer."""

    runner: str
    a2a: str
    fmt: WeightFormat
    dtype: torch.dtype
    facts: DeviceFacts
    shape: ExpertShape

    @property
    def exactness_mode(self) -> bool:
        return self.dtype == torch.float32


def resolve_runner(name: str, kind: str) -> str:
    """``auto`` -> triton on CUDA, torch elsewhere."""
    if name == "auto":
        return "triton" if kind == "cuda" else "torch"
    return name


# --- refusals: (when, message) -------------------------------------------------------------------


def _needs_cuda(c: Case) -> bool:
    return c.runner in ("triton", "deep_gemm") and c.facts.kind != "cuda"


def _deep_gemm_mxfp4_off_grid(c: Case) -> bool:
    return (
        c.runner == "deep_gemm"
        and c.fmt is WeightFormat.MXFP4
        and not c.exactness_mode
        and _mega_kernel_for(c) is None
        and not c.shape.fp8_grid_fits
    )


Refusal = tuple[Callable[[Case], bool], Callable[[Case], str]]

# Refusals the flags and the device decide alone (``ServerArgs.validate`` asks these before the
# model loads: :func:`flags_refusal`).
FLAG_REFUSALS: tuple[Refusal, ...] = (
    (
        _needs_cuda,
        lambda c: (
            f"--moe-runner-backend {c.runner} needs a CUDA device, this is {c.facts.name}; use "
            "--moe-runner-backend auto (torch off CUDA) or torch"
        ),
    ),
    (
        lambda c: c.runner == "deep_gemm" and not c.facts.deep_gemm,
        lambda c: (
            f"--moe-runner-backend deep_gemm needs a usable DeepGEMM, which {c.facts.name} does "
            "not have (python -m sglang.check_env says why); use --moe-runner-backend triton"
        ),
    ),
    (
        lambda c: c.runner == "deep_gemm" and c.exactness_mode,
        lambda c: (
            "--moe-runner-backend deep_gemm runs bf16/FP8 experts, not --dtype float32; use "
            "--dtype bfloat16, or --moe-runner-backend torch for the exactness check"
        ),
    ),
)

# Refusals that also need the checkpoint's expert format and the layer's shapes (the loader asks
# them for every layer before it reads a tensor).
REFUSALS: tuple[Refusal, ...] = (
    *FLAG_REFUSALS,
    (
        _deep_gemm_mxfp4_off_grid,
        lambda c: (
            "--moe-runner-backend deep_gemm takes MXFP4 experts converted to FP8 128x128 blocks, "
            f"which needs the hidden size ({c.shape.hidden}) and this rank's intermediate slice "
            f"({c.shape.local_intermediate}) in multiples of {FP8_BLOCK}; use "
            "--moe-runner-backend triton, or a --tp-size / --ep-size that keeps the slice a "
            f"multiple of {FP8_BLOCK}"
        ),
    ),
)


# --- residency -----------------------------------------------------------------------------------


def mega_kernel_reason(c: Case) -> str | None:
    """Why DeepGEMM's MegaMoE kernel cannot keep this layer's experts as its only copy (None: it
    can; then :func:`_mega_kernel_for` names it)."""
    if c.a2a != "megamoe":
        return f"--moe-a2a-backend {c.a2a} runs no MegaMoE kernel"
    if not c.facts.deep_gemm:
        return f"DeepGEMM is unusable on {c.facts.name}"
    if c.facts.arch < _FIRST_DEEP_GEMM_ARCH:
        return f"DeepGEMM has no MegaMoE kernel for {c.facts.name}"
    if c.fmt is WeightFormat.BF16:
        return "bf16 experts have no MegaMoE layout"
    kernel = mega_moe_kernel_name(c.facts.arch)
    wants = MEGA_KERNEL_FORMAT[kernel]
    # Hopper's kernel reads FP8, which MXFP4 becomes at load; Blackwell's reads MXFP4 only.
    convertible = wants is WeightFormat.FP8 and c.fmt is WeightFormat.MXFP4
    if c.fmt is not wants and not convertible:
        return (
            f"DeepGEMM's {kernel} on sm_{c.facts.arch} takes {wants.value} experts; these are "
            f"{c.fmt.value}"
        )
    shape = mega_moe_shape_reason(c.shape.mega_params, c.facts.arch)
    if shape is not None:
        return f"DeepGEMM's {kernel}: {shape}"
    if c.shape.hidden % FP8_BLOCK or c.shape.intermediate % FP8_BLOCK:
        return (
            f"the MegaMoE weight layout tiles hidden ({c.shape.hidden}) and intermediate "
            f"({c.shape.intermediate}) by {FP8_BLOCK}"
        )
    if c.facts.arch < _FIRST_BLACKWELL_ARCH and c.dtype != torch.bfloat16:
        return f"DeepGEMM's {kernel} pre-dispatch takes bf16 activations, not {c.dtype}"
    return None


def _mega_kernel_for(c: Case) -> str | None:
    """DeepGEMM's MegaMoE kernel that can keep this layer's experts as its only copy, or None."""
    if mega_kernel_reason(c) is not None:
        return None
    return mega_moe_kernel_name(c.facts.arch)


@dataclass(frozen=True)
class Residency:
    resident: WeightFormat
    layout: ExpertLayout
    conversion: Conversion
    mega_kernel: str | None = None


def _keep_unquantised(c: Case) -> Residency | None:
    if c.fmt is not WeightFormat.BF16:
        return None
    return Residency(WeightFormat.BF16, ExpertLayout.STANDARD, Conversion.NONE)


def _dequantise_for_exactness(c: Case) -> Residency | None:
    if c.fmt is not WeightFormat.MXFP4 or not c.exactness_mode:
        return None
    return Residency(WeightFormat.BF16, ExpertLayout.STANDARD, Conversion.DEQUANTISE)


def _mega_copy_only(c: Case) -> Residency | None:
    kernel = _mega_kernel_for(c)
    if kernel is None:
        return None
    wants = MEGA_KERNEL_FORMAT[kernel]
    conversion = Conversion.NONE if c.fmt is wants else Conversion.MXFP4_TO_FP8
    return Residency(wants, ExpertLayout.MEGA, conversion, kernel)


def _fp8_for_deep_gemm(c: Case) -> Residency | None:
    if c.fmt is not WeightFormat.MXFP4 or c.runner != "deep_gemm":
        return None
    return Residency(WeightFormat.FP8, ExpertLayout.STANDARD, Conversion.MXFP4_TO_FP8)


def _as_stored(c: Case) -> Residency | None:
    return Residency(c.fmt, ExpertLayout.STANDARD, Conversion.NONE)


# First match wins (the module docstring's list, in order).
RESIDENCY: tuple[Callable[[Case], Residency | None], ...] = (
    _keep_unquantised,
    _mega_copy_only,
    _dequantise_for_exactness,
    _fp8_for_deep_gemm,
    _as_stored,
)


# --- what the runner runs ------------------------------------------------------------------------


def runner_path(
    runner: str, resident: WeightFormat, layout: ExpertLayout, facts: DeviceFacts
) -> str:
    """What ``runner`` runs on experts kept as ``resident`` in ``layout``."""
    if layout is ExpertLayout.MEGA and resident is WeightFormat.MXFP4 and runner == "triton":
        return "fused_experts_mxfp4 reading the MegaMoE copy in place (Triton W4A16)"
    if layout is ExpertLayout.MEGA:
        return (
            "batches the MegaMoE kernel does not take read the experts they route to from the "
            "MegaMoE copy on use"
        )
    if resident is WeightFormat.MXFP4:
        if runner == "triton":
            return "fused_experts_mxfp4 (Triton W4A16, 4-bit weights read in the kernel)"
        return "the routed experts dequantised on use, then the runner's torch loop"
    kind = {WeightFormat.FP8: "FP8 128x128 (W8A8)", WeightFormat.BF16: "unquantised"}[resident]
    return {
        "torch": f"torch loop over the routed experts, {kind}",
        "triton": f"fused_experts (Triton), {kind}",
        "deep_gemm": f"DeepGEMM grouped GEMMs, {kind} (Triton where it measured faster)",
    }.get(runner, kind)


def live_flag_facts(device: torch.device, runner: str) -> DeviceFacts:
    """The facts :func:`flags_refusal` reads, from this machine (DeepGEMM is looked up only for
    the deep_gemm runner on CUDA)."""
    deep_gemm = False
    if device.type == "cuda" and resolve_runner(runner, device.type) == "deep_gemm":
        from sglang.srt.layers.deep_gemm_adapter import deep_gemm_status

        deep_gemm = deep_gemm_status().usable
    return DeviceFacts(device.type, device.type, 0, deep_gemm=deep_gemm)


def flags_refusal(runner: str, a2a: str, dtype: torch.dtype, facts: DeviceFacts) -> str | None:
    """Why these flags cannot run on a device with ``facts`` whatever the checkpoint holds
    (:data:`FLAG_REFUSALS`), or None."""
    # A placeholder layer: the flag-level rules read neither the format nor the shapes.
    shape = ExpertShape(1, FP8_BLOCK, FP8_BLOCK, FP8_BLOCK, 1)
    case = Case(resolve_runner(runner, facts.kind), a2a, WeightFormat.BF16, dtype, facts, shape)
    return next((message(case) for when, message in FLAG_REFUSALS if when(case)), None)


def plan_experts(
    *,
    runner: str,
    a2a: str,
    fmt: WeightFormat,
    dtype: torch.dtype,
    facts: DeviceFacts,
    shape: ExpertShape,
) -> ExpertPlan:
    """The plan for one layer, or :class:`ExpertPlanError` naming the flag to change."""
    case = Case(resolve_runner(runner, facts.kind), a2a, WeightFormat(fmt), dtype, facts, shape)
    for when, message in REFUSALS:
        if when(case):
            raise ExpertPlanError(message(case))
    r = next(found for rule in RESIDENCY if (found := rule(case)) is not None)
    return ExpertPlan(
        runner=case.runner,
        a2a=a2a,
        checkpoint=case.fmt,
        resident=r.resident,
        dtype=dtype,
        layout=r.layout,
        conversion=r.conversion,
        mega_kernel=r.mega_kernel,
        runner_path=runner_path(case.runner, r.resident, r.layout, facts),
        mega_reason=None if a2a != "megamoe" or r.mega_kernel else mega_kernel_reason(case),
    )


# --- the MegaMoE kernel of a batch (--moe-a2a-backend megamoe) ----------------------------------


@dataclass(frozen=True)
class MegaKernelChoice:
    """Which MegaMoE kernel takes a batch: ``deep_gemm`` (DeepGEMM's, for this GPU), ``triton``
    (ours) or ``none`` (the runner's path); ``why`` says why."""

    backend: str
    why: str

    def describe(self) -> str:
        if self.backend == "deep_gemm":
            return f"DeepGEMM's {self.why}"
        if self.backend == "triton":
            return f"our Triton persistent kernel (DeepGEMM's cannot run: {self.why})"
        return f"the normal MoE path ({self.why})"


@dataclass(frozen=True)
class MegaKernelPlan:
    """What decides a layer's MegaMoE kernel and stays the same from batch to batch: why
    DeepGEMM's kernel (``deep_gemm_kernel``) cannot take the layer (None: it takes batches of up
    to ``max_tokens`` tokens a rank, of bf16 activations only where ``bf16_only``), why our
    Triton kernel cannot (None: it takes the rest, where it did not measure slower than the
    runner at ``measured``)."""

    deep_gemm_kernel: str
    deep_gemm_reason: str | None
    bf16_only: bool
    max_tokens: int
    triton_reason: str | None
    measured: MoeShape
    measured_dtype: str

    def deep_gemm_batch_reason(self, num_tokens: int, dtype: torch.dtype) -> str | None:
        """Why DeepGEMM's kernel cannot take a batch of ``num_tokens`` ``dtype`` rows."""
        if self.deep_gemm_reason is not None:
            return self.deep_gemm_reason
        off = unfit_reason("deep_gemm_mega")  # turned off by a build failure since the plan
        if off is not None:
            return off
        if self.bf16_only and dtype != torch.bfloat16:
            return f"its SM90 pre-dispatch takes bf16 activations, not {dtype}"
        if num_tokens > self.max_tokens:
            return (
                f"batch of {num_tokens} tokens exceeds "
                f"SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK={self.max_tokens}"
            )
        return None

    def kernel_for(self, num_tokens: int, dtype: torch.dtype) -> MegaKernelChoice:
        """The kernel a batch of ``num_tokens`` ``dtype`` rows takes: DeepGEMM's first, then
        ours."""
        dg_reason = self.deep_gemm_batch_reason(num_tokens, dtype)
        if dg_reason is None:
            return MegaKernelChoice("deep_gemm", self.deep_gemm_kernel)
        triton_reason = self.triton_reason or unfit_reason("mega_moe_triton")
        if triton_reason is not None:
            return MegaKernelChoice(
                "none", f"DeepGEMM's kernel: {dg_reason}; our Triton kernel: {triton_reason}"
            )
        slower = mega_moe_measured_slower(self.measured, self.measured_dtype, num_tokens)
        if slower is not None:  # the user's MegaMoE, but not where it measured slower
            return MegaKernelChoice("none", f"our Triton MegaMoE {slower}")
        return MegaKernelChoice("triton", dg_reason)


def plan_mega_kernel(
    deep_gemm: Any,
    *,
    arch: int,
    group_size: int,
    params: MegaMoEParams,
    device: torch.device,
    mega_weights: object | None,
    local_weights: ExpertWeights | None,
) -> MegaKernelPlan:
    """The MegaMoE plan of one layer: ``deep_gemm`` (the module, None when unusable) on compute
    capability ``arch``, an expert-parallel group of ``group_size`` ranks on ``device``,
    DeepGEMM-layout ``mega_weights`` if built and this rank's ``local_weights`` as the runner
    holds them."""
    dg_reason = "MegaMoE weights were not built" if mega_weights is None else None
    if dg_reason is None:
        dg_reason = mega_moe_layer_reason(deep_gemm, arch, params)
    w13 = local_weights.w13.dtype if local_weights is not None else torch.bfloat16
    return MegaKernelPlan(
        deep_gemm_kernel=f"{mega_moe_kernel_name(arch)} (sm_{arch})",
        deep_gemm_reason=dg_reason,
        bf16_only=bf16_activations_only(arch),
        max_tokens=mega_moe_max_tokens(),
        triton_reason=triton_mega_unavailable_reason(
            device, local_weights, group_size, params.num_topk
        ),
        measured=MoeShape(
            params.num_experts, params.num_topk, params.hidden, params.intermediate_hidden
        ),
        measured_dtype=dtype_key(w13),
    )
