"""The SM budget of whole-grid MoE kernels, and the context that narrows DeepGEMM to it.

A whole-grid kernel (one CTA per SM behind a software grid barrier) stalls, or fails with
"grid sync timeout", when another stream holds even one SM: some CTAs never become resident.
DeepGEMM's MegaMoE kernels are such launches on every architecture they exist for:
``fp8_fp4_mega_moe`` on Blackwell, and ``fp8_mega_moe`` on Hopper (on an H200 it waits out a
one-SM side-stream kernel at 132 SMs and not at 130; the measurement is in docs/reserved_sms.md
and docs/performance.md). So that one kernel call runs on fewer SMs than the GPU has, and every
other DeepGEMM call keeps the original count.

A leaf module: the DeepGEMM MegaMoE path, our Triton MegaMoE, ``check_env`` and the scheduler all
read the budget here. The budget starts from the *physical* SM count (device properties), never
from ``deep_gemm.get_num_sms()``, which other features may have narrowed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.deep_gemm_adapter import DEEP_GEMM_SM_LOCK
from sglang.srt.utils.device import device_sm_info
from sglang.srt.utils.log import get_logger, log_once

logger = get_logger(__name__)

# Compute capabilities whose DeepGEMM MegaMoE kernel is a whole-grid launch: Hopper's
# fp8_mega_moe (0.1.5.post1) and Blackwell's fp8_fp4_mega_moe.
WHOLE_GRID_MEGA_MOE_ARCHS = frozenset({90, 100, 103})
MIN_SMS = 2


def mega_moe_sm_budget(device: int | torch.device | None = None) -> int | None:
    """SMs a whole-grid MoE kernel may use on ``device``: physical SMs minus
    ``SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS``, at least 2, rounded down to even (clustered
    launches take SMs in pairs). ``None`` when the reserve is 0 (reservation off).

    Independent of architecture, so a whole-grid kernel of our own is sized by it too."""
    reserved = envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.get()
    if reserved == 0:
        return None
    physical = device_sm_info(device).num_sms
    budget = max(MIN_SMS, physical - reserved)
    return max(MIN_SMS, budget - budget % 2)


def deep_gemm_sm_budget(device: int | torch.device | None = None) -> int | None:
    """The SM budget for DeepGEMM's MegaMoE kernel on ``device``, or ``None`` where no
    reservation applies: reserve 0, or an architecture DeepGEMM has no whole-grid MegaMoE for.

    The physical SM count is cached per device index, so a process that sees GPUs with different
    SM counts gets the right value for each."""
    if device_sm_info(device).arch not in WHOLE_GRID_MEGA_MOE_ARCHS:
        return None
    return mega_moe_sm_budget(device)


# Upstream SGLang's name for it, which its MegaMoE patch and code written against it use.
_mega_moe_max_num_sms = deep_gemm_sm_budget


def _narrowed_num_sms(budget: int, current: int) -> int:
    """``min(budget, current)`` rounded down to even; never above ``current`` (an outer caller
    may already have narrowed it) and never below 2 (then ``current`` is kept)."""
    target = min(budget, current)
    target -= target % 2
    return target if target >= MIN_SMS else current


@contextmanager
def _configure_mega_moe_deep_gemm_num_sms(
    deep_gemm: Any, device: int | torch.device | None = None
) -> Iterator[int | None]:
    """Narrow DeepGEMM's SM count for the body only; yields the count in effect (``None`` when
    no reservation applies).

    Wrap exactly the MegaMoE kernel call. The previous value is restored on every exit, errors
    included. The body runs under :data:`DEEP_GEMM_SM_LOCK`, so another thread's DeepGEMM call
    (made through ``deep_gemm_call_guard``) never sees the narrowed value."""
    budget = deep_gemm_sm_budget(device)
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
