"""Kernel families turned off while the engine runs, after one failed to build.

A decision function asks :func:`family_off_reason` before it chooses its kernel, so a family that
failed to compile or load during warm-up (or CUDA-graph capture) is not chosen again and its
fallback runs instead. Which family a failure belongs to is read from the failure's traceback:
the innermost frame in one of a family's modules (:data:`sglang.kernels.fit.families.FAMILIES`).
"""

from __future__ import annotations

import threading
import types

from sglang.kernels.fit.families import FAMILIES, KernelFamily

_lock = threading.Lock()
_off: dict[str, str] = {}

# Packages whose errors mean "this kernel could not be built or loaded" (compile errors, shared
# memory or thread limits, ptxas, TileLang / TVM lowering, DeepGEMM's JIT).
_BUILD_PACKAGES = ("triton", "tilelang", "tvm", "tvm_ffi", "deep_gemm")


def family_off_reason(name: str) -> str | None:
    """Why the family ``name`` is off (None: it may be chosen)."""
    return _off.get(name)


def turn_family_off(name: str, reason: str) -> bool:
    """Turn ``name`` off for the rest of the process; False when it already was."""
    if name not in {f.name for f in FAMILIES}:
        raise KeyError(f"unknown kernel family {name!r}")
    with _lock:
        if name in _off:
            return False
        _off[name] = reason
        return True


def families_off_count() -> int:
    """How many families are off (a cheap key for callers that cache a choice)."""
    return len(_off)


def families_off() -> dict[str, str]:
    """Every family turned off so far, with why."""
    return dict(_off)


def reset_families() -> None:
    """Turn every family back on (tests)."""
    with _lock:
        _off.clear()


def _frames(exc: BaseException) -> list[types.FrameType]:
    """The frames of ``exc``'s traceback and of the exceptions it was raised from, outermost
    first within each."""
    out: list[types.FrameType] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        tb = cur.__traceback__
        while tb is not None:
            out.append(tb.tb_frame)
            tb = tb.tb_next
        cur = cur.__cause__ or cur.__context__
    return out


def _top_package(module: object) -> str:
    return str(module or "").split(".")[0]


def is_build_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a kernel that failed to compile or load (raised by Triton, TileLang /
    TVM or DeepGEMM), not a failure of the engine around it."""
    if _top_package(type(exc).__module__) in _BUILD_PACKAGES:
        return True
    frames = _frames(exc)
    return bool(frames) and _top_package(frames[-1].f_globals.get("__name__")) in _BUILD_PACKAGES


def failed_family(exc: BaseException) -> KernelFamily | None:
    """The family whose launch raised ``exc`` (the innermost frame in one of its modules), or
    None when ``exc`` is no kernel build failure or no family's code is on its stack."""
    if not is_build_failure(exc):
        return None
    by_module = {m: f for f in FAMILIES for m in f.modules}
    for frame in reversed(_frames(exc)):
        family = by_module.get(str(frame.f_globals.get("__name__")))
        if family is not None:
            return family
    return None
