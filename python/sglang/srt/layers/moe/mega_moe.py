"""MegaMoE: the reserved-SM control and the symmetric-buffer cache.

DeepGEMM's MegaMoE kernel (``fp8_fp4_mega_moe`` on Blackwell) launches one CTA per SM in clusters
behind a whole-grid software barrier. If a kernel on another stream holds even one SM, some CTAs
never become resident and the barrier times out ("grid sync timeout") or hangs. The fix is to
launch that one kernel on fewer SMs than the GPU has, leaving a margin, and to leave every other
DeepGEMM call (gate, top-k, buffer set-up, pre-dispatch, other layers) on the original count.

The budget starts from the *physical* SM count (device properties), not from
``deep_gemm.get_num_sms()``, because other features narrow DeepGEMM's process-wide value.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.deep_gemm_adapter import (
    DEEP_GEMM_SM_LOCK,
    mega_moe_buffer_depends_on_num_sms,
)
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.quantization.mxfp4 import UE8M0_BIAS as _UE8M0_BIAS
from sglang.srt.utils.device import device_sm_info
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)

# DeepGEMM's SM90 MegaMoE does not use the clustered whole-grid launch, so no reservation applies.
_FIRST_WHOLE_GRID_ARCH = 100
_MIN_SMS = 2


def mega_moe_sm_budget(device: int | torch.device | None = None) -> int | None:
    """SMs a whole-grid MoE kernel may use on ``device``: physical SMs minus
    ``SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS``, at least 2, rounded down to even (clustered
    launches take SMs in pairs). ``None`` when the reserve is 0 (reservation off).

    Independent of architecture, so a whole-grid kernel of our own can be sized by it too."""
    reserved = envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.get()
    if reserved == 0:
        return None
    physical = device_sm_info(device).num_sms
    budget = max(_MIN_SMS, physical - reserved)
    return max(_MIN_SMS, budget - budget % 2)


def _mega_moe_max_num_sms(device: int | torch.device | None = None) -> int | None:
    """The SM budget for DeepGEMM's MegaMoE kernel on ``device``, or ``None`` where no
    reservation applies (reserve 0, or an architecture whose MegaMoE is not a whole-grid launch).

    The physical SM count is cached per device index, so a process that sees GPUs with different
    SM counts gets the right value for each."""
    if device_sm_info(device).arch < _FIRST_WHOLE_GRID_ARCH:
        return None
    return mega_moe_sm_budget(device)


def _narrowed_num_sms(budget: int, current: int) -> int:
    """``min(budget, current)`` rounded down to even; never above ``current`` (an outer caller
    may already have narrowed it) and never below 2 (then ``current`` is kept)."""
    target = min(budget, current)
    target -= target % 2
    return target if target >= _MIN_SMS else current


@contextmanager
def _configure_mega_moe_deep_gemm_num_sms(
    deep_gemm: Any, device: int | torch.device | None = None
) -> Iterator[int | None]:
    """Narrow DeepGEMM's SM count for the body only; yields the count in effect.

    Wrap exactly the MegaMoE kernel call. The previous value is restored on every exit, errors
    included. The body runs under :data:`DEEP_GEMM_SM_LOCK`, so another thread's DeepGEMM call
    (made through ``deep_gemm_call_guard``) never sees the narrowed value."""
    budget = _mega_moe_max_num_sms(device)
    with DEEP_GEMM_SM_LOCK:
        if budget is None:
            yield None
            return
        previous = int(deep_gemm.get_num_sms())
        target = _narrowed_num_sms(budget, previous)
        if target == previous:
            yield previous
            return
        log_once(
            logger,
            logging.INFO,
            f"MegaMoE SM budget: {target} SMs for the kernel (physical "
            f"{device_sm_info(device).num_sms}, SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS="
            f"{envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.get()}, DeepGEMM had {previous})",
        )
        deep_gemm.set_num_sms(target)
        try:
            yield target
        finally:
            deep_gemm.set_num_sms(previous)


# --- symmetric-buffer cache -----------------------------------------------------------------


@dataclass(frozen=True)
class MegaMoEBufferKey:
    """Exactly what decides a MegaMoE symmetric buffer's size and layout.

    ``num_sms`` is set only when the installed DeepGEMM sizes the buffer from its SM count;
    otherwise changing the reserve must not reallocate (the buffer is a collective allocation
    over the whole EP group)."""

    group_id: int
    num_max_tokens_per_rank: int
    num_experts: int
    num_topk: int
    hidden: int
    intermediate_hidden: int
    activation: str
    mma_type: str
    num_shared_experts: int = 0
    num_sms: int | None = None


_symm_buffers: dict[MegaMoEBufferKey, tuple[Any, Any]] = {}
_symm_buffers_lock = threading.RLock()  # held across creation: it is a collective


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
    num_shared_experts: int = 0,
    device: int | torch.device | None = None,
) -> Any:
    """The cached ``deep_gemm.get_symm_buffer_for_mega_moe`` buffer for these parameters.

    When the installed DeepGEMM sizes the buffer from its SM count, the buffer is created inside
    the reserved-SM context and keyed on the effective count, so a buffer is never used with a
    count it was not sized for. Otherwise it is created on the original count and shared across
    reserve settings."""

    def make_key(num_sms: int | None) -> MegaMoEBufferKey:
        return MegaMoEBufferKey(
            group_id=id(group),
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            num_experts=num_experts,
            num_topk=num_topk,
            hidden=hidden,
            intermediate_hidden=intermediate_hidden,
            activation=activation,
            mma_type=mma_type,
            num_shared_experts=num_shared_experts,
            num_sms=num_sms,
        )

    def create() -> Any:
        return deep_gemm.get_symm_buffer_for_mega_moe(
            group,
            num_experts,
            num_max_tokens_per_rank,
            num_topk,
            hidden,
            intermediate_hidden,
            num_shared_experts=num_shared_experts,
            mma_type=mma_type,
            activation=activation,
        )

    def lookup(key: MegaMoEBufferKey, factory: Callable[[], Any]) -> Any:
        with _symm_buffers_lock:
            hit = _symm_buffers.get(key)
            if hit is None:
                # The group is kept alive beside the buffer, so its id() cannot be reused.
                hit = _symm_buffers[key] = (group, factory())
            return hit[1]

    if not mega_moe_buffer_depends_on_num_sms(deep_gemm):
        return lookup(make_key(None), create)
    with _configure_mega_moe_deep_gemm_num_sms(deep_gemm, device):
        effective = int(deep_gemm.get_num_sms())
        return lookup(make_key(effective), create)


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
        raise ValueError(f"hidden {hidden} must be a multiple of {group_size * 4} for packed UE8M0 scales")
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


def mega_moe_kernel_name(arch: int) -> str:
    """DeepGEMM's MegaMoE kernel for compute capability ``arch`` (e.g. 100, 90): the Blackwell
    whole-grid ``fp8_fp4_mega_moe`` (MXFP4 experts) or the Hopper ``fp8_mega_moe`` (FP8 experts).
    The one place this choice is made, so the runtime and the weight loader cannot disagree."""
    return "fp8_fp4_mega_moe" if arch >= _FIRST_WHOLE_GRID_ARCH else "fp8_mega_moe"


def mega_moe_unusable_reason(deep_gemm: Any, num_tokens: int, arch: int) -> str | None:
    """Why the MegaMoE path cannot take this batch (``None`` when it can)."""
    if deep_gemm is None:
        return "DeepGEMM is unusable"
    for name in (mega_moe_kernel_name(arch), "get_symm_buffer_for_mega_moe"):
        if not callable(getattr(deep_gemm, name, None)):
            return f"the installed DeepGEMM has no {name}()"
    cap = envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.get()
    if num_tokens > cap:
        return (
            f"batch of {num_tokens} tokens exceeds SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK={cap}"
        )
    return None


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
    kernel call runs inside the reserved-SM context."""
    num_tokens = x.shape[0]
    cap = envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.get()
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
        device=device,
    )
    weights = topk_weights.float()  # routed scaling is already in them (select_experts)
    arch = device_sm_info(device).arch
    # At least one row, so the kernel gets a valid pointer on a rank with no tokens.
    y = torch.empty(max(num_tokens, 1), params.hidden, dtype=torch.bfloat16, device=x.device)
    kwargs: dict[str, Any] = {"activation": params.activation, "fast_math": True}
    if params.activation_clamp is not None:
        kwargs["activation_clamp"] = params.activation_clamp
    if arch >= _FIRST_WHOLE_GRID_ARCH:
        mega_moe_pre_dispatch(x, topk_ids, weights, buf, group_size=32)
        with _configure_mega_moe_deep_gemm_num_sms(deep_gemm, device):
            deep_gemm.fp8_fp4_mega_moe(y, l1_weights, l2_weights, buf, recipe=(1, 1, 32), **kwargs)
    else:
        # Hopper: DeepGEMM's own pre-dispatch (128-value groups) and no reservation.
        deep_gemm.mega_moe_pre_dispatch_sm90(
            x, topk_ids.int(), weights, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights,
            num_tokens=num_tokens, group_size=128,
        )
        with _configure_mega_moe_deep_gemm_num_sms(deep_gemm, device):
            deep_gemm.fp8_mega_moe(y, l1_weights, l2_weights, buf, recipe=(128, 128, 128), **kwargs)
    return y[:num_tokens]


def try_run_mega_routed(
    deep_gemm: Any,
    group: Any,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    mega_weights: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None,
    params: MegaMoEParams,
    *,
    device: int | torch.device | None = None,
    local_weights: ExpertWeights | None = None,
) -> torch.Tensor | None:
    """The MegaMoE path when it can take this batch, else ``None`` (the caller runs the normal
    path) after one log line saying why.

    DeepGEMM's kernel first; where it is unusable (no DeepGEMM, no built weights, e.g. on our
    Hopper machines) our Triton persistent kernel takes single-GPU calls from ``local_weights``."""
    reason = "MegaMoE weights were not built" if mega_weights is None else None
    if reason is None:
        arch = device_sm_info(device).arch if deep_gemm is not None else 0
        reason = mega_moe_unusable_reason(deep_gemm, x.shape[0], arch)
    if reason is None:
        assert mega_weights is not None
        return run_mega_routed_experts(
            deep_gemm, group, x, topk_ids, topk_weights, mega_weights[0], mega_weights[1], params, device=device
        )
    from sglang.srt.layers.moe.mega_moe_triton_backend import (
        run_triton_mega_routed,
        triton_mega_config,
    )

    group_size = int(getattr(group, "world_size", 1)) if group is not None else 1
    config, triton_reason = triton_mega_config(x, local_weights, group_size, params.num_topk)
    if config is not None:
        assert local_weights is not None
        return run_triton_mega_routed(
            x, topk_ids, topk_weights, local_weights, activation=params.activation,
            swiglu_limit=params.activation_clamp, config=config,
        )  # fmt: skip
    log_once(
        logger,
        logging.WARNING,
        f"MegaMoE falls back to the normal MoE path: DeepGEMM's kernel: {reason}; our Triton "
        f"kernel: {triton_reason}",
    )
    return None
