"""DeepGEMM's MegaMoE: its fused MoE kernels, their symmetric-buffer cache, the pre-dispatch that
stages a batch into that buffer, and why the kernel cannot take a layer or a batch. Which MegaMoE
kernel takes a batch (DeepGEMM's, our Triton one, or none) is the expert plan's decision
(:mod:`sglang.srt.layers.moe.expert_plan`).

DeepGEMM's MegaMoE kernels (``fp8_fp4_mega_moe`` on Blackwell, ``fp8_mega_moe`` on Hopper) are
whole-grid launches: one CTA per SM behind a software grid barrier. They run inside the
reserved-SM context of :mod:`sglang.srt.layers.moe.sm_budget`; buffer set-up and pre-dispatch
keep DeepGEMM's original SM count.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sglang.kernels.fit.decide import unfit_reason
from sglang.srt.environ import envs
from sglang.srt.layers.deep_gemm_adapter import has_entry_point, resolve_entry_point
from sglang.srt.layers.moe.moe_runner.base import moe_output_scope
from sglang.srt.layers.moe.sm_budget import (  # noqa: F401  (the seed's names, importable here)
    _configure_mega_moe_deep_gemm_num_sms,
    _mega_moe_max_num_sms,
    _narrowed_num_sms,
    mega_moe_sm_budget,
)
from sglang.srt.layers.quantization.mxfp4 import UE8M0_BIAS as _UE8M0_BIAS
from sglang.srt.utils.device import device_sm_info

_FIRST_BLACKWELL_ARCH = 100
# DeepGEMM 0.1.5.post1's SM90 fp8_mega_moe: SwiGLU only, intermediate <= 4096, 128-wide tiles.
SM90_MAX_INTERMEDIATE = 4096


# --- symmetric-buffer cache -----------------------------------------------------------------


@dataclass(frozen=True)
class MegaMoEBufferKey:
    """What decides a MegaMoE symmetric buffer's size and layout, and nothing else: not the SM
    count, so changing the reserve never reallocates (the buffer is a collective allocation over
    the whole expert-parallel group)."""

    group_id: int
    num_max_tokens_per_rank: int
    num_experts: int
    num_topk: int
    hidden: int
    intermediate_hidden: int
    activation: str
    mma_type: str


_symm_buffers: dict[MegaMoEBufferKey, tuple[Any, Any]] = {}
_symm_buffers_lock = threading.RLock()  # held across creation: it is a collective
_single_rank_group: list[Any] = []


def mega_moe_process_group(group: Any) -> Any:
    """The torch ProcessGroup DeepGEMM's buffer is made over: the TP group's device group, or,
    with no group (one GPU outside the engine), a one-rank NCCL group of this process."""
    device_group = getattr(group, "device_group", None)
    if device_group is not None:
        return device_group
    if group is not None:
        return group  # already a ProcessGroup (or a test's stand-in)
    if not _single_rank_group:
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl",
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                device_id=torch.device("cuda", torch.cuda.current_device()),
            )
        if dist.get_world_size() != 1:
            raise RuntimeError(
                "MegaMoE without a TP group needs a one-process torch.distributed world"
            )
        _single_rank_group.append(dist.group.WORLD)
    return _single_rank_group[0]


def _get_mega_moe_symm_buffer(
    deep_gemm: Any,
    group: Any,
    *,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate_hidden: int,
    activation: str = "swiglu",
    mma_type: str = "fp8xfp4",
) -> Any:
    """The cached ``deep_gemm.get_symm_buffer_for_mega_moe`` buffer for these parameters, made
    on DeepGEMM's original SM count (outside the reserved-SM context)."""
    key = MegaMoEBufferKey(
        id(group),
        num_max_tokens_per_rank,
        num_experts,
        num_topk,
        hidden,
        intermediate_hidden,
        activation,
        mma_type,
    )
    with _symm_buffers_lock:
        hit = _symm_buffers.get(key)
        if hit is None:
            make = resolve_entry_point(deep_gemm, "mega_moe_buffer")
            buf = make(
                mega_moe_process_group(group),
                num_experts,
                num_max_tokens_per_rank,
                num_topk,
                hidden,
                intermediate_hidden,
                mma_type=mma_type,
                activation=activation,
            )
            # The group is kept alive beside the buffer, so its id() cannot be reused.
            hit = _symm_buffers[key] = (group, buf)
        return hit[1]


def clear_mega_moe_symm_buffers() -> None:
    """Drop cached buffers (tests, and model teardown)."""
    with _symm_buffers_lock:
        _symm_buffers.clear()


# --- the MegaMoE forward ------------------------------------------------------------------------

_FP8_MAX = 448.0


@dataclass(frozen=True)
class MegaMoEParams:
    """What one MegaMoE layer passes to the kernel (the same for every layer of a model)."""

    num_experts: int
    num_topk: int
    hidden: int
    intermediate_hidden: int
    activation: str = "swiglu"
    activation_clamp: float | None = None
    mma_type: str = "fp8xfp4"


def mega_moe_pre_dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    buf: Any,
    *,
    group_size: int = 32,
) -> None:
    """Stage this rank's tokens into the symmetric buffer, outside the reserved-SM context.

    Per token and per ``group_size`` values: scale = 2^ceil(log2(amax / 448)) (a UE8M0 byte),
    ``buf.x = e4m3(x / scale)``; the scale bytes are packed four to an int32 in ``buf.x_sf``.
    Top-k ids (int64) and weights (fp32) are copied; rows ``[T, capacity)`` get id -1, weight 0,
    so the kernel skips them."""
    t, hidden = x.shape
    capacity = buf.topk_idx.shape[0]
    if t > capacity:
        raise ValueError(f"{t} tokens exceed the MegaMoE buffer's {capacity} tokens per rank")
    if hidden % (group_size * 4):
        raise ValueError(
            f"hidden {hidden} must be a multiple of {group_size * 4} for packed UE8M0 scales"
        )
    groups = x[:t].float().view(t, hidden // group_size, group_size)
    amax = groups.abs().amax(-1).clamp_min(1e-10)
    exponent = torch.ceil(torch.log2(amax / _FP8_MAX))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    buf.x[:t].copy_(scaled.view(t, hidden).to(torch.float8_e4m3fn))
    sf_bytes = (exponent + _UE8M0_BIAS).clamp(0, 255).to(torch.uint8)
    buf.x_sf[:t].copy_(sf_bytes.view(torch.int32))
    buf.topk_idx[:t].copy_(topk_ids.to(torch.int64))
    buf.topk_weights[:t].copy_(topk_weights.to(torch.float32))
    buf.topk_idx[t:].fill_(-1)
    buf.topk_weights[t:].fill_(0)


def kernel_arch(deep_gemm: Any, device: int | torch.device | None) -> int:
    """The compute capability DeepGEMM's MegaMoE kernels are chosen for (0 without DeepGEMM:
    no device is asked)."""
    return device_sm_info(device).arch if deep_gemm is not None else 0


def mega_moe_kernel_name(arch: int) -> str:
    """DeepGEMM's MegaMoE kernel for compute capability ``arch`` (e.g. 100, 90): the Blackwell
    ``fp8_fp4_mega_moe`` (MXFP4 experts) or the Hopper ``fp8_mega_moe`` (FP8 experts).
    The one place this choice is made, so the runtime and the weight loader cannot disagree."""
    return "fp8_fp4_mega_moe" if arch >= _FIRST_BLACKWELL_ARCH else "fp8_mega_moe"


def _kernel_capabilities(arch: int) -> tuple[str, ...]:
    if arch >= _FIRST_BLACKWELL_ARCH:
        return ("sm100_mega_moe", "mega_moe_buffer")
    return ("sm90_mega_moe", "sm90_mega_moe_pre_dispatch", "mega_moe_buffer")


def mega_moe_shape_reason(params: MegaMoEParams, arch: int) -> str | None:
    """Why DeepGEMM's MegaMoE kernel for ``arch`` cannot take a layer of these parameters."""
    if arch < _FIRST_BLACKWELL_ARCH:
        if params.hidden % 128 or params.intermediate_hidden % 128:
            return (
                f"its SM90 kernel takes hidden ({params.hidden}) and intermediate "
                f"({params.intermediate_hidden}) in multiples of 128"
            )
        if params.activation != "swiglu":
            return (
                f"its SM90 kernel has SwiGLU only, not {params.activation!r} (SiTU is SM100-only)"
            )
        if params.intermediate_hidden > SM90_MAX_INTERMEDIATE:
            return (
                f"its SM90 kernel takes intermediate <= {SM90_MAX_INTERMEDIATE}, "
                f"not {params.intermediate_hidden}"
            )
    return None


def mega_moe_layer_reason(
    deep_gemm: Any, arch: int, params: MegaMoEParams | None = None
) -> str | None:
    """Why DeepGEMM's MegaMoE kernel for ``arch`` cannot take a layer of ``params``, whatever
    the batch (``None`` when it can)."""
    if deep_gemm is None:
        return "DeepGEMM is unusable"
    off = unfit_reason("deep_gemm_mega")
    if off is not None:
        return off
    for capability in _kernel_capabilities(arch):
        if not has_entry_point(deep_gemm, capability):
            return f"the installed DeepGEMM has no {capability} entry point"
    if params is not None:
        return mega_moe_shape_reason(params, arch)
    return None


def bf16_activations_only(arch: int) -> bool:
    """Whether the kernel for ``arch`` takes bf16 activations only: Hopper's, whose pre-dispatch
    is DeepGEMM's (Blackwell's is ours and takes any float)."""
    return arch < _FIRST_BLACKWELL_ARCH


def mega_moe_max_tokens() -> int:
    """The most tokens a rank stages into DeepGEMM's MegaMoE buffer
    (``SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK``): a larger batch cannot take it."""
    return envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.get()


def run_mega_routed_experts(
    deep_gemm: Any,
    group: Any,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l1_weights: tuple[torch.Tensor, torch.Tensor],
    l2_weights: tuple[torch.Tensor, torch.Tensor],
    params: MegaMoEParams,
    *,
    device: int | torch.device | None = None,
) -> torch.Tensor:
    """Routed experts through DeepGEMM's MegaMoE: returns this rank's rows fully combined
    across the expert-parallel group, so no all-reduce follows.

    Order matters: buffer set-up and pre-dispatch run on DeepGEMM's original SM count; only the
    kernel call runs inside the reserved-SM context. Every step is a fixed-shape device op, so
    the call can be captured in a CUDA graph once its buffer exists."""
    num_tokens = x.shape[0]
    cap = mega_moe_max_tokens()
    arch = device_sm_info(device).arch
    buf = _get_mega_moe_symm_buffer(
        deep_gemm,
        group,
        num_experts=params.num_experts,
        num_max_tokens_per_rank=cap,
        num_topk=params.num_topk,
        hidden=params.hidden,
        intermediate_hidden=params.intermediate_hidden,
        activation=params.activation,
        mma_type=params.mma_type,
    )
    weights = topk_weights.float()  # routed scaling is already in them (select_experts)
    # The final output (bf16, as the kernels write it), allocated like every runner's: the
    # symmetric pool when on. At least one row, so the kernel gets a valid pointer on a rank
    # with no tokens.
    with moe_output_scope():
        y = torch.empty(max(num_tokens, 1), params.hidden, dtype=torch.bfloat16, device=x.device)
    kwargs: dict[str, Any] = {"activation": params.activation, "fast_math": True}
    if params.activation_clamp is not None:
        kwargs["activation_clamp"] = params.activation_clamp
    if arch >= _FIRST_BLACKWELL_ARCH:
        mega_moe_pre_dispatch(x, topk_ids, weights, buf, group_size=32)
        kernel = resolve_entry_point(deep_gemm, "sm100_mega_moe")
        with _configure_mega_moe_deep_gemm_num_sms(deep_gemm, device):
            kernel(y, l1_weights, l2_weights, buf, recipe=(1, 1, 32), **kwargs)
    else:
        # Hopper: DeepGEMM's own pre-dispatch (fp32 scales per 128 values, int32 ids in).
        pre_dispatch = resolve_entry_point(deep_gemm, "sm90_mega_moe_pre_dispatch")
        pre_dispatch(
            x,
            topk_ids.int(),
            weights,
            buf.x,
            buf.x_sf,
            buf.topk_idx,
            buf.topk_weights,
            num_tokens=num_tokens,
            group_size=128,
        )
        kernel = resolve_entry_point(deep_gemm, "sm90_mega_moe")
        with _configure_mega_moe_deep_gemm_num_sms(deep_gemm, device):
            kernel(y, l1_weights, l2_weights, buf, recipe=(128, 128, 128), **kwargs)
    return y[:num_tokens]
