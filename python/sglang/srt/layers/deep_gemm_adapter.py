"""A thin, lazy adapter over the optional DeepGEMM package (``sgl-deep-gemm``).

DeepGEMM wheels are built against one torch release; on another they may fail to import or
garble tensor arguments. The engine therefore treats DeepGEMM as an optional backend: this module
reports whether it is usable and why not, in one log line, and never lets an import failure
escape into ``import sglang``.

DeepGEMM keeps one process-wide SM count (``set_num_sms``). :data:`DEEP_GEMM_SM_LOCK` guards it:
code that narrows the count holds the lock for the narrowed region, and every other DeepGEMM call
made by the engine goes through :func:`deep_gemm_call_guard`, so one thread's narrowed value never
reaches another thread's call.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import torch

from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

DEEP_GEMM_SM_LOCK = threading.RLock()

# Compute capabilities (major*10+minor) that DeepGEMM ships kernels for.
_SUPPORTED_ARCHS = (90, 100, 103)


@dataclass(frozen=True)
class DeepGemmStatus:
    usable: bool
    reason: str
    module: ModuleType | None = None
    version: str | None = None


def _probe(module_name: str) -> DeepGemmStatus:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        return DeepGemmStatus(False, "not installed (pip install 'sglang[deep-gemm]')")
    except Exception as exc:  # a wheel built for another torch fails here in many ways
        return DeepGemmStatus(False, f"failed to load: {type(exc).__name__}: {exc}")
    version = getattr(module, "__version__", None)
    for attr in ("get_num_sms", "set_num_sms"):
        if not callable(getattr(module, attr, None)):
            return DeepGemmStatus(False, f"loaded but lacks {attr}()", module, version)
    if not torch.cuda.is_available():
        return DeepGemmStatus(False, "no CUDA device", module, version)
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    if arch not in _SUPPORTED_ARCHS:
        return DeepGemmStatus(False, f"unsupported architecture sm_{arch}", module, version)
    return DeepGemmStatus(True, f"version {version or 'unknown'} on sm_{arch}", module, version)


@functools.lru_cache(maxsize=None)
def deep_gemm_status(module_name: str = "deep_gemm") -> DeepGemmStatus:
    """Import DeepGEMM once and say, in one log line, whether it can be used."""
    status = _probe(module_name)
    level = logging.INFO if status.usable else logging.WARNING
    verdict = "usable" if status.usable else "unusable, using other MoE paths"
    logger.log(level, "DeepGEMM %s: %s", verdict, status.reason)
    return status


def get_deep_gemm() -> ModuleType | None:
    """The DeepGEMM module when usable, else ``None``."""
    status = deep_gemm_status()
    return status.module if status.usable else None


@contextmanager
def deep_gemm_call_guard() -> Iterator[None]:
    """Hold the SM-count lock around a DeepGEMM call outside the MegaMoE context, so the call
    runs with the process-wide value and not another thread's narrowed one."""
    with DEEP_GEMM_SM_LOCK:
        yield


def mega_moe_buffer_depends_on_num_sms(deep_gemm: object) -> bool:
    """Whether this DeepGEMM sizes its MegaMoE symmetric buffer from the current SM count.

    Recent DeepGEMM releases do (the buffer holds per-SM scratch), and the public API does not
    say which releases, so assume it does unless the module declares
    ``MEGA_MOE_BUFFER_USES_NUM_SMS = False``. Assuming wrongly costs one extra buffer when the
    reserve changes; the opposite mistake would run a kernel on a buffer too small for it."""
    return bool(getattr(deep_gemm, "MEGA_MOE_BUFFER_USES_NUM_SMS", True))
