"""A thin, lazy adapter over the optional DeepGEMM package (``sgl-deep-gemm``).

Each DeepGEMM wheel's ``_C.so`` links libtorch and reads tensors through accessors compiled
against one torch ABI. On another torch it may fail to import, or import fine and then receive
garbled tensors ("dim == 2 or dim == 3" assertions, wrong results). So before the engine uses it:

1. the installed release is checked against the torch it was built for (:data:`TORCH_OF_RELEASE`)
   *before* importing it; a known mismatch is reported and the module is never imported;
2. after import, a tiny grouped GEMM round trip is run on the GPU and its result compared with
   torch's; an error or a wrong result makes DeepGEMM unusable.

Either failure is one log line, and the engine uses its other MoE paths. Entry points are looked
up by capability (:func:`resolve_entry_point`), since their names differ between releases.

DeepGEMM keeps one process-wide SM count (``set_num_sms``). :data:`DEEP_GEMM_SM_LOCK` guards it:
code that narrows the count holds the lock for the narrowed region, and every other DeepGEMM call
made by the engine goes through :func:`deep_gemm_call_guard`, so one thread's narrowed value never
reaches another thread's call.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from packaging.version import InvalidVersion, Version

from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

DEEP_GEMM_SM_LOCK = threading.RLock()

# Compute capabilities (major*10+minor) that DeepGEMM ships kernels for.
_SUPPORTED_ARCHS = (90, 100, 103)
# How a wheel built for another torch (or CUDA) fails on import or on its first GEMM: a missing
# symbol (ImportError/OSError), or the C++ side's checks on garbled shapes (RuntimeError,
# AssertionError, or the ValueError/TypeError that tvm-ffi maps its errors to).
_LOAD_ERRORS = (ImportError, OSError, RuntimeError, AssertionError, ValueError, TypeError)
DISTRIBUTION = "sgl-deep-gemm"

# sgl-deep-gemm releases (first, last) -> the torch (major, minor) range their _C.so was built
# against. Measured on the H200s with torch 2.11 (docs/moe.md): 0.1.5.post2-0.2.1 import and then
# garble every tensor; 0.2.1.post1 and later fail to import.
TORCH_OF_RELEASE: tuple[tuple[tuple[str, str], tuple[tuple[int, int], tuple[int, int]]], ...] = (
    (("0.0.1", "0.1.5.post1"), ((2, 10), (2, 12))),
    (("0.1.5.post2", "0.2.1"), ((2, 13), (2, 13))),
    (("0.2.1.post1", "0.2.5"), ((2, 14), (2, 14))),
)

# Capability -> the names it has had across releases, newest first. 0.1.5.post1 names masked FP8
# ``m_grouped_fp8_fp4_gemm_nt_masked`` (alias ``fp8_m_grouped_gemm_nt_masked``).
ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "fp8_gemm": ("fp8_fp4_gemm_nt", "fp8_gemm_nt"),
    "fp8_contiguous": ("m_grouped_fp8_fp4_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_contiguous"),
    "fp8_masked": (
        "m_grouped_fp8_fp4_gemm_nt_masked",
        "fp8_m_grouped_gemm_nt_masked",
        "m_grouped_fp8_gemm_nt_masked",
    ),
    "bf16_contiguous": ("m_grouped_bf16_gemm_nt_contiguous",),
    "bf16_masked": ("m_grouped_bf16_gemm_nt_masked", "bf16_m_grouped_gemm_nt_masked"),
    "contiguous_alignment": (
        "get_mk_alignment_for_contiguous_layout",
        "get_m_alignment_for_contiguous_layout",
    ),
    "mega_moe_buffer": ("get_symm_buffer_for_mega_moe",),
    "sm90_mega_moe": ("fp8_mega_moe",),
    "sm90_mega_moe_weights": ("transform_weights_for_mega_moe_sm90",),
    "sm90_mega_moe_pre_dispatch": ("mega_moe_pre_dispatch_sm90",),
    "sm100_mega_moe": ("fp8_fp4_mega_moe",),
}


class DeepGemmEntryPointError(RuntimeError):
    """The installed DeepGEMM has no function for a capability the engine needs."""


def resolve_entry_point(module: Any, capability: str) -> Callable[..., Any]:
    """The function of ``module`` that provides ``capability`` (a key of :data:`ENTRY_POINTS`)."""
    names = ENTRY_POINTS[capability]
    for name in names:
        fn = getattr(module, name, None)
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    version = getattr(module, "__version__", "unknown")
    raise DeepGemmEntryPointError(
        f"the installed DeepGEMM ({version}) has no {capability} entry point (looked for "
        f"{', '.join(names)})"
    )


def has_entry_point(module: Any, capability: str) -> bool:
    return any(callable(getattr(module, n, None)) for n in ENTRY_POINTS[capability])


def torch_range_of_release(version: str) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The torch (major, minor) range ``version`` of sgl-deep-gemm was built for, if known."""
    try:
        v = Version(version)
        for (first, last), torch_range in TORCH_OF_RELEASE:
            if Version(first) <= v <= Version(last):
                return torch_range
    except InvalidVersion:
        return None
    return None


def torch_mismatch(version: str, torch_version: str) -> str | None:
    """Why release ``version`` cannot run on ``torch_version`` (``None``: fits, or unknown)."""
    torch_range = torch_range_of_release(version)
    if torch_range is None:
        return None
    running = Version(torch_version.split("+")[0]).release[:2]
    (lo, hi) = torch_range
    if lo <= running <= hi:
        return None
    built = f"{lo[0]}.{lo[1]}" if lo == hi else f"{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}"
    return (
        f"{DISTRIBUTION} {version} was built for torch {built}, this is torch {torch_version}; "
        f"install {suggested_release(torch_version)}"
    )


def suggested_release(torch_version: str) -> str:
    """The pip requirement that fits ``torch_version``, per :data:`TORCH_OF_RELEASE`."""
    running = Version(torch_version.split("+")[0]).release[:2]
    for (first, last), (lo, hi) in TORCH_OF_RELEASE:
        if lo <= running <= hi:
            return f"'{DISTRIBUTION}>={first},<={last}'"
    return f"a {DISTRIBUTION} built for torch {running[0]}.{running[1]}"


@dataclass(frozen=True)
class DeepGemmStatus:
    usable: bool
    reason: str
    module: ModuleType | None = None
    version: str | None = None


def _installed_release() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def self_check(module: Any, device: torch.device | None = None) -> str | None:
    """Run a tiny masked bf16 grouped GEMM through ``module`` and compare with torch: ``None``
    when it matches, else what went wrong. A wheel built for another torch fails here (an
    assertion on garbled shapes, or a wrong result), so it never runs on real tensors."""
    dev = device or torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(2, 64, 256, device=dev, generator=gen).to(torch.bfloat16)
    b = torch.randn(2, 128, 256, device=dev, generator=gen).to(torch.bfloat16)
    d = torch.zeros(2, 64, 128, device=dev, dtype=torch.bfloat16)
    masked_m = torch.tensor([64, 3], dtype=torch.int32, device=dev)
    try:
        resolve_entry_point(module, "bf16_masked")(a, b, d, masked_m, 32)
        torch.cuda.synchronize(dev)
    except _LOAD_ERRORS as exc:  # garbled tensors surface as assertion errors from the C++ side
        return f"its self-check GEMM failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    ref = torch.einsum("emk,enk->emn", a.float(), b.float())
    for e, m in enumerate((64, 3)):
        err = ((d[e, :m].float() - ref[e, :m]).norm() / ref[e, :m].norm()).item()
        if not err < 2e-2:  # bf16 output of a 256-long dot: ~2e-3
            return f"its self-check GEMM gave a wrong result (relative error {err:.3g})"
    return None


def _probe(
    module_name: str, *, check_release: bool = True, run_self_check: bool = True
) -> DeepGemmStatus:
    release = _installed_release() if module_name == "deep_gemm" else None
    if check_release and release is not None:
        mismatch = torch_mismatch(release, torch.__version__)
        if mismatch is not None:  # never import it: a wrong-ABI import may succeed and garble
            return DeepGemmStatus(False, mismatch, None, release)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        return DeepGemmStatus(
            False, f"not installed (pip install {suggested_release(torch.__version__)})"
        )
    except _LOAD_ERRORS as exc:  # a wheel built for another torch fails here in many ways
        return DeepGemmStatus(False, f"failed to load: {type(exc).__name__}: {exc}", None, release)
    version = str(getattr(module, "__version__", None) or release or "unknown")
    for attr in ("get_num_sms", "set_num_sms"):
        if not callable(getattr(module, attr, None)):
            return DeepGemmStatus(False, f"{version} loaded but lacks {attr}()", module, version)
    if not torch.cuda.is_available():
        return DeepGemmStatus(False, "no CUDA device", module, version)
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    if arch not in _SUPPORTED_ARCHS:
        return DeepGemmStatus(False, f"unsupported architecture sm_{arch}", module, version)
    if run_self_check:
        failure = self_check(module)
        if failure is not None:
            hint = torch_mismatch(version, torch.__version__) or (
                f"is it built for this torch {torch.__version__}? "
                f"{suggested_release(torch.__version__)} fits"
            )
            return DeepGemmStatus(False, f"{version}: {failure}; {hint}", None, version)
    return DeepGemmStatus(
        True, f"version {version} on sm_{arch}, torch {torch.__version__}", module, version
    )


@functools.cache
def deep_gemm_status(module_name: str = "deep_gemm") -> DeepGemmStatus:
    """Check and import DeepGEMM once, and say in one log line whether it can be used."""
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
