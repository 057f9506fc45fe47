"""ctypes binding to ``libnccl.so.2``: the few NCCL entry points the engine calls directly.

Nothing is loaded at import, so this module imports on machines without NCCL; the library is
opened by the first :func:`get_nccl_library` call. Every call's ``ncclResult_t`` is checked and a
failure raises :class:`NcclError` with NCCL's own error string.

Where the library comes from, in order: ``SGLANG_NCCL_SO_PATH``; the ``libnccl.so.2`` this process
already mapped (torch's copy, so one NCCL instance serves c10d and us); the ``nvidia-nccl-cu13`` /
``nvidia-nccl-cu12`` wheel under site-packages; the system loader.
"""

from __future__ import annotations

import ctypes
import glob
import os
import site
import sys
import threading
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from sglang.srt.environ import envs
from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)

NCCL_SONAME = "libnccl.so.2"

# nccl.h (2.27+): window flags and the alignment a window start must have inside its allocation.
NCCL_WIN_DEFAULT = 0x00
NCCL_WIN_COLL_SYMMETRIC = 0x01
NCCL_WIN_REQUIRED_ALIGNMENT = 4096

# The window API and symmetric kernels appeared in 2.27.3.
SYMM_MEM_MIN_NCCL_VERSION: tuple[int, int, int] = (2, 27, 3)

_RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
}


class NcclDataType(IntEnum):
    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    FLOAT8_E4M3 = 10
    FLOAT8_E5M2 = 11


class NcclRedOp(IntEnum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]

    def to_bytes(self) -> bytes:
        return bytes(bytearray(self.internal))

    @classmethod
    def from_bytes(cls, raw: bytes) -> NcclUniqueId:
        if len(raw) != 128:
            raise ValueError(f"an NCCL unique id has 128 bytes, got {len(raw)}")
        uid = cls()
        ctypes.memmove(ctypes.addressof(uid), raw, 128)
        return uid


class NcclError(RuntimeError):
    """An NCCL call returned something other than ncclSuccess."""

    def __init__(self, function: str, code: int, detail: str) -> None:
        name = _RESULT_NAMES.get(code, f"code {code}")
        super().__init__(f"{function} failed: {name} ({code}): {detail}")
        self.function = function
        self.code = code


class NcclUnavailableError(RuntimeError):
    """libnccl.so.2 could not be found or loaded, or lacks a needed symbol."""


@dataclass(frozen=True)
class NcclVersion:
    major: int
    minor: int
    patch: int

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.patch)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def parse_nccl_version(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s integer as (major, minor, patch).

    From 2.9 on the code is ``major*10000 + minor*100 + patch`` (22809 -> 2.28.9); before that it
    was ``major*1000 + minor*100 + patch`` (2708 -> 2.7.8)."""
    if code < 0:
        raise ValueError(f"invalid NCCL version code {code}")
    if code >= 10000:
        return (code // 10000, (code % 10000) // 100, code % 100)
    return (code // 1000, (code % 1000) // 100, code % 100)


def format_version(version: tuple[int, int, int]) -> str:
    return ".".join(str(v) for v in version)


# --- locating the library ------------------------------------------------------------------


def _loaded_nccl_path() -> str | None:
    """The ``libnccl.so.2`` already mapped into this process (e.g. by torch), if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libnccl.so") and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return None


def _site_dirs() -> list[str]:
    dirs: list[str] = []
    try:
        dirs.extend(site.getsitepackages())
    except AttributeError:  # some virtualenvs lack it
        pass
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:
        pass
    dirs.extend(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    unique: list[str] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def wheel_nccl_candidates() -> list[str]:
    """``libnccl.so.2`` files shipped by nvidia-nccl wheels, in preference order."""
    found: list[str] = []
    for base in _site_dirs():
        for sub in ("nvidia/nccl/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"):
            found.extend(sorted(glob.glob(os.path.join(base, sub, "libnccl.so.2*"))))
    return [p for p in found if os.path.isfile(p)]


def find_nccl_library() -> str:
    """The path (or bare soname, for the system loader) that :func:`get_nccl_library` opens."""
    override = envs.SGLANG_NCCL_SO_PATH.get()
    if override:
        if not os.path.isfile(override):
            raise NcclUnavailableError(f"SGLANG_NCCL_SO_PATH={override!r} is not a file")
        return override
    loaded = _loaded_nccl_path()
    if loaded is not None:
        return loaded
    wheels = wheel_nccl_candidates()
    if wheels:
        return wheels[0]
    return NCCL_SONAME


# --- the binding ---------------------------------------------------------------------------

_c = ctypes
_REQUIRED: dict[str, tuple[Any, list[Any]]] = {
    "ncclGetVersion": (_c.c_int, [_c.POINTER(_c.c_int)]),
    "ncclGetErrorString": (_c.c_char_p, [_c.c_int]),
    "ncclGetUniqueId": (_c.c_int, [_c.POINTER(NcclUniqueId)]),
    "ncclCommInitRank": (_c.c_int, [_c.POINTER(_c.c_void_p), _c.c_int, NcclUniqueId, _c.c_int]),
    "ncclCommDestroy": (_c.c_int, [_c.c_void_p]),
    "ncclAllReduce": (
        _c.c_int,
        [_c.c_void_p, _c.c_void_p, _c.c_size_t, _c.c_int, _c.c_int, _c.c_void_p, _c.c_void_p],
    ),
}
# Present only in newer releases; bound when found, and their absence is reported on use.
_OPTIONAL: dict[str, tuple[Any, list[Any]]] = {
    "ncclGetLastError": (_c.c_char_p, [_c.c_void_p]),
    "ncclMemAlloc": (_c.c_int, [_c.POINTER(_c.c_void_p), _c.c_size_t]),
    "ncclMemFree": (_c.c_int, [_c.c_void_p]),
    "ncclCommWindowRegister": (
        _c.c_int,
        [_c.c_void_p, _c.c_void_p, _c.c_size_t, _c.POINTER(_c.c_void_p), _c.c_int],
    ),
    "ncclCommWindowDeregister": (_c.c_int, [_c.c_void_p, _c.c_void_p]),
}


class NcclLibrary:
    """One opened ``libnccl.so.2`` with typed, return-code-checked wrappers."""

    def __init__(self, path: str) -> None:
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as exc:
            raise NcclUnavailableError(
                f"cannot load NCCL from {path!r}: {exc}. Install nvidia-nccl-cu13 (or -cu12) or "
                "set SGLANG_NCCL_SO_PATH to a libnccl.so.2"
            ) from exc
        self.path = path
        self._fns: dict[str, Any] = {}
        for name, (restype, argtypes) in _REQUIRED.items():
            fn = getattr(self._lib, name, None)
            if fn is None:
                raise NcclUnavailableError(f"{path} has no symbol {name}")
            fn.restype, fn.argtypes = restype, argtypes
            self._fns[name] = fn
        for name, (restype, argtypes) in _OPTIONAL.items():
            fn = getattr(self._lib, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = restype, argtypes
                self._fns[name] = fn

    # -- helpers

    def has(self, name: str) -> bool:
        return name in self._fns

    def _fn(self, name: str) -> Any:
        fn = self._fns.get(name)
        if fn is None:
            raise NcclUnavailableError(
                f"{self.path} (NCCL {self.version_string()}) has no {name}; "
                f"NCCL >= {format_version(SYMM_MEM_MIN_NCCL_VERSION)} is needed"
            )
        return fn

    def error_string(self, code: int) -> str:
        raw = self._fns["ncclGetErrorString"](code)
        return raw.decode(errors="replace") if raw else "unknown error"

    def check(self, name: str, code: int, comm: int | None = None) -> None:
        if code == 0:
            return
        detail = self.error_string(code)
        if comm and "ncclGetLastError" in self._fns:
            last = self._fns["ncclGetLastError"](ctypes.c_void_p(comm))
            if last:
                detail = f"{detail} ({last.decode(errors='replace')})"
        raise NcclError(name, code, detail)

    # -- version

    def version_code(self) -> int:
        out = ctypes.c_int()
        self.check("ncclGetVersion", self._fns["ncclGetVersion"](ctypes.byref(out)))
        return out.value

    def version(self) -> tuple[int, int, int]:
        return parse_nccl_version(self.version_code())

    def version_string(self) -> str:
        return format_version(self.version())

    # -- communicators

    def get_unique_id(self) -> NcclUniqueId:
        uid = NcclUniqueId()
        self.check("ncclGetUniqueId", self._fns["ncclGetUniqueId"](ctypes.byref(uid)))
        return uid

    def comm_init_rank(self, world_size: int, uid: NcclUniqueId, rank: int) -> int:
        comm = ctypes.c_void_p()
        code = self._fns["ncclCommInitRank"](ctypes.byref(comm), world_size, uid, rank)
        self.check("ncclCommInitRank", code)
        if not comm.value:
            raise NcclError("ncclCommInitRank", 3, "returned a NULL communicator")
        return comm.value

    def comm_destroy(self, comm: int) -> None:
        self.check("ncclCommDestroy", self._fns["ncclCommDestroy"](ctypes.c_void_p(comm)))

    def all_reduce(
        self, send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int
    ) -> None:
        code = self._fns["ncclAllReduce"](
            ctypes.c_void_p(send),
            ctypes.c_void_p(recv),
            count,
            dtype,
            op,
            ctypes.c_void_p(comm),
            ctypes.c_void_p(stream),
        )
        self.check("ncclAllReduce", code, comm)

    # -- memory and windows (2.27.3+ for windows)

    def mem_alloc(self, size: int) -> int:
        ptr = ctypes.c_void_p()
        self.check("ncclMemAlloc", self._fn("ncclMemAlloc")(ctypes.byref(ptr), size))
        return int(ptr.value or 0)

    def mem_free(self, ptr: int) -> None:
        self.check("ncclMemFree", self._fn("ncclMemFree")(ctypes.c_void_p(ptr)))

    def function_address(self, name: str) -> int:
        """The C address of ``name`` (for a C shim that must call the same NCCL instance)."""
        return int(ctypes.cast(self._fn(name), ctypes.c_void_p).value or 0)

    def comm_window_register(self, comm: int, ptr: int, size: int, flags: int) -> int:
        win = ctypes.c_void_p()
        code = self._fn("ncclCommWindowRegister")(
            ctypes.c_void_p(comm), ctypes.c_void_p(ptr), size, ctypes.byref(win), flags
        )
        self.check("ncclCommWindowRegister", code, comm)
        return int(win.value or 0)

    def comm_window_deregister(self, comm: int, window: int) -> None:
        code = self._fn("ncclCommWindowDeregister")(ctypes.c_void_p(comm), ctypes.c_void_p(window))
        self.check("ncclCommWindowDeregister", code, comm)


_library: NcclLibrary | None = None
_library_lock = threading.Lock()


def get_nccl_library() -> NcclLibrary:
    """The process-wide binding, opened on first use (raises :class:`NcclUnavailableError`)."""
    global _library
    with _library_lock:
        if _library is None:
            path = find_nccl_library()
            _library = NcclLibrary(path)
            logger.info("NCCL %s loaded from %s", _library.version_string(), path)
        return _library


def nccl_version() -> tuple[int, int, int]:
    return get_nccl_library().version()


def require_nccl_version(
    minimum: tuple[int, int, int],
    feature: str,
    *,
    found: tuple[int, int, int] | None = None,
) -> tuple[int, int, int]:
    """Return the NCCL version, or raise naming ``feature``, the minimum and what was found.

    ``found`` skips loading the library (tests, or a caller that already knows)."""
    if found is None:
        try:
            found = nccl_version()
        except NcclUnavailableError as exc:
            raise NcclUnavailableError(
                f"{feature} needs NCCL >= {format_version(minimum)}, but NCCL is unavailable: {exc}"
            ) from exc
    if tuple(found) < tuple(minimum):
        where = f" ({_library.path})" if _library is not None else ""
        raise RuntimeError(
            f"{feature} needs NCCL >= {format_version(minimum)}, found {format_version(found)}"
            f"{where}. Install a newer nvidia-nccl-cu13 wheel or point SGLANG_NCCL_SO_PATH at one."
        )
    return found
