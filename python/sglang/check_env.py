"""``python -m sglang.check_env``: what this machine offers the engine, and what it would choose.

Prints versions, the GPUs, whether DeepGEMM is usable (and why not), which kernels each routed
expert format (bf16, FP8, MXFP4) takes here and in what format it stays resident (the MoE expert
table, ``layers/moe/expert_plan.py``), the MegaMoE SM budget per GPU, and every environment knob
with its value. Exits non-zero when a knob holds a bad value.
"""

from __future__ import annotations

import platform
import sys

import torch

from sglang.srt.environ import Envs, EnvValueError
from sglang.srt.layers.deep_gemm_adapter import deep_gemm_status
from sglang.srt.layers.moe.expert_plan import (
    CPU,
    DeviceFacts,
    ExpertPlanError,
    ExpertShape,
    plan_experts,
)
from sglang.srt.layers.moe.expert_weights import WeightFormat
from sglang.srt.layers.moe.moe_runner.path_table import DSV4, K3, MoeShape
from sglang.srt.layers.moe.sm_budget import deep_gemm_sm_budget, mega_moe_sm_budget
from sglang.srt.utils.device import device_sm_info
from sglang.srt.utils.env_check import unknown_env_vars
from sglang.version import __version__

_NO_DEEP_GEMM_NARROWING = "no change (reserve 0, or no DeepGEMM MegaMoE here)"


def _optional_version(name: str) -> str:
    try:
        module = __import__(name)
    except Exception as exc:  # noqa: BLE001 - optional packages may be missing or broken
        return f"unavailable ({type(exc).__name__})"
    return str(getattr(module, "__version__", "unknown"))


def _mega_moe_summary(deep_gemm_usable: bool) -> str:
    """Which MegaMoE kernel each kind of layer takes here, and why (the forward decides per
    layer with the same rules: ``expert_plan.plan_mega_kernel``)."""
    if not deep_gemm_usable:
        return (
            "our Triton persistent kernel (DeepGEMM is unusable; one GPU, else the normal MoE path)"
        )
    arch = device_sm_info().arch if torch.cuda.is_available() else 0
    if arch >= 100:
        return (
            "DeepGEMM's fp8_fp4_mega_moe for MXFP4 experts (SwiGLU and SiTU); "
            "our Triton kernel otherwise"
        )
    return (
        "DeepGEMM's fp8_mega_moe for FP8 128x128 experts with SwiGLU and intermediate <= 4096 "
        "(DeepSeek V4); our Triton kernel for SiTU (Kimi K3: DeepGEMM's is SM100-only), bf16 "
        "experts and other shapes"
    )


def _shape(shape: MoeShape, activation: str, limit: float | None) -> ExpertShape:
    return ExpertShape(
        shape.experts, shape.hidden, shape.inter, shape.inter, shape.top_k, activation, limit
    )


# The routed experts of the two models at their release widths (one rank).
MODEL_EXPERTS = (
    ("DeepSeek V4", _shape(DSV4, "swiglu", 10.0)),
    ("Kimi K3", _shape(K3, "situ", None)),
)


def device_facts_here(deep_gemm_usable: bool) -> DeviceFacts:
    if not torch.cuda.is_available():
        return CPU
    info = device_sm_info()
    return DeviceFacts(
        f"{torch.cuda.get_device_name()} (sm_{info.arch})",
        "cuda",
        info.arch,
        deep_gemm=deep_gemm_usable,
    )


def expert_plan_lines(facts: DeviceFacts, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Per expert format and a2a backend (``--moe-runner-backend auto``), what each model's
    routed experts keep resident and which kernels run them on a device with ``facts``."""
    lines = []
    for fmt in WeightFormat:
        for a2a in ("none", "megamoe"):
            for model, shape in MODEL_EXPERTS:
                try:
                    plan = plan_experts(
                        runner="auto", a2a=a2a, fmt=fmt, dtype=dtype, facts=facts, shape=shape
                    )
                    text = plan.describe()
                    if plan.mega_reason is not None:
                        text += f" (no MegaMoE kernel: {plan.mega_reason})"
                except ExpertPlanError as exc:
                    text = f"refused: {exc}"
                lines.append(f"{fmt.value} experts, --moe-a2a-backend {a2a}, {model}: {text}")
    return lines


def main() -> int:
    print(f"sglang {__version__}, Python {platform.python_version()}, torch {torch.__version__}")
    for name in ("triton", "transformers", "tilelang"):
        print(f"  {name}: {_optional_version(name)}")
    status = deep_gemm_status()
    print(f"  DeepGEMM: {'usable' if status.usable else 'unusable'} ({status.reason})")
    print(f"  --moe-a2a-backend megamoe runs: {_mega_moe_summary(status.usable)}")
    facts = device_facts_here(status.usable)
    dtype = torch.bfloat16 if facts.kind == "cuda" else torch.float32  # --dtype auto
    print(
        f"\nRouted experts on {facts.name} (--moe-runner-backend auto, --dtype "
        f"{str(dtype).removeprefix('torch.')}):"
    )
    for line in expert_plan_lines(facts, dtype):
        print(f"  {line}")

    ok = True
    print("\nEnvironment knobs:")
    for name, field in Envs.fields().items():
        try:
            value = field.get()
            shown = f"{value!r}" + ("" if field.is_set() else " (default)")
        except EnvValueError as exc:
            shown, ok = f"ERROR: {exc}", False
        print(f"  {name} = {shown}")
    for message in unknown_env_vars():
        print(f"  WARNING: {message}")

    if not torch.cuda.is_available():
        print("\nNo CUDA device: the engine runs its CPU paths (torch MoE runner, gloo).")
        return 0 if ok else 1
    print("\nGPUs:")
    for index in range(torch.cuda.device_count()):
        info = device_sm_info(index)
        try:
            budget, dg_budget = mega_moe_sm_budget(index), deep_gemm_sm_budget(index)
        except EnvValueError:
            budget = dg_budget = None
        print(
            f"  cuda:{index} {torch.cuda.get_device_name(index)} sm_{info.arch}, "
            f"{info.num_sms} SMs; whole-grid MoE budget {budget}; DeepGEMM MegaMoE narrowed to "
            f"{dg_budget if dg_budget is not None else _NO_DEEP_GEMM_NARROWING}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
