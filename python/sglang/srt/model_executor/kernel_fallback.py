"""Warm-up steps that survive a kernel which fails to build.

Kernels are chosen by fit before they launch (``sglang.kernels.fit``), so a configuration the
device cannot hold is never tried. What a formula cannot foresee (a compiler error on this
Triton, a DeepGEMM or TileLang JIT failure) surfaces on the first launch, which the start-up
warm-up and the CUDA-graph warm-up runs make: there the failing kernel's family is turned off
(one warning line naming it, the error and what runs instead) and the step runs again, so the
engine starts on the fallback path instead of dying.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sglang.kernels.fit.families import FAMILIES
from sglang.kernels.fit.switch import failed_family, turn_family_off
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

T = TypeVar("T")


def _summary(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:300]}" if first else type(exc).__name__


def run_with_kernel_fallback(step: Callable[[], T], what: str) -> T:
    """``step()``; when a kernel fails to build inside it, turn its family off and run ``step``
    again (each family at most once). Any other error, or a failure of a family already off
    (its decision function did not take the fallback), is raised."""
    for _ in range(len(FAMILIES) + 1):
        try:
            return step()
        except Exception as exc:
            family = failed_family(exc)
            if family is None or not turn_family_off(family.name, _summary(exc)):
                raise
            logger.warning(
                f"{what}: the {family.name} kernels failed to build ({_summary(exc)}); "
                f"{family.fallback} runs instead"
            )
    raise AssertionError("unreachable: every family can be turned off only once")
