"""The C shim behind the symmetric pool: torch's pluggable-allocator hooks over ncclMemAlloc.

``torch.cuda.memory.CUDAPluggableAllocator`` needs two C symbols,
``void* alloc(size_t size, int device, void* stream)`` and
``void free(void* ptr, size_t size, int device, void* stream)``. This shim provides them and, in
an append-only log, records every segment it hands out (base, size, device, live), so the Python
side can register each new segment as an NCCL window exactly once.

The shim does not link NCCL: Python passes it the addresses of ``ncclMemAlloc``/``ncclMemFree``
from the already-loaded binding, so the pool and the communicator use one NCCL instance and the
build needs only ``gcc`` (no CUDA or NCCL headers). It is compiled lazily into a cache directory,
to a temporary name then atomically renamed, under a file lock, so concurrent ranks are safe.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

ALLOC_SYMBOL = "sglang_symm_alloc"
FREE_SYMBOL = "sglang_symm_free"

SHIM_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <pthread.h>

typedef int (*sglang_alloc_fn)(void**, size_t);
typedef int (*sglang_free_fn)(void*);

typedef struct {
  uintptr_t base;
  size_t size;
  int device;
  int live;
} sglang_segment;

static sglang_alloc_fn g_alloc = NULL;
static sglang_free_fn g_free = NULL;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static sglang_segment* g_log = NULL;
static size_t g_len = 0, g_cap = 0;
static size_t g_frees = 0;
static int g_last_error = 0;

void sglang_symm_set_backend(void* alloc_fn, void* free_fn) {
  pthread_mutex_lock(&g_lock);
  g_alloc = (sglang_alloc_fn)alloc_fn;
  g_free = (sglang_free_fn)free_fn;
  pthread_mutex_unlock(&g_lock);
}

void* sglang_symm_alloc(size_t size, int device, void* stream) {
  (void)stream;
  void* ptr = NULL;
  sglang_alloc_fn fn = g_alloc;
  if (fn == NULL) { g_last_error = -1; return NULL; }
  int rc = fn(&ptr, size);
  if (rc != 0 || ptr == NULL) { g_last_error = rc != 0 ? rc : -2; return NULL; }
  pthread_mutex_lock(&g_lock);
  if (g_len == g_cap) {
    size_t cap = g_cap ? 2 * g_cap : 64;
    sglang_segment* grown = (sglang_segment*)realloc(g_log, cap * sizeof(sglang_segment));
    if (grown == NULL) {
      pthread_mutex_unlock(&g_lock);
      if (g_free) g_free(ptr);
      g_last_error = -3;
      return NULL;
    }
    g_log = grown;
    g_cap = cap;
  }
  g_log[g_len].base = (uintptr_t)ptr;
  g_log[g_len].size = size;
  g_log[g_len].device = device;
  g_log[g_len].live = 1;
  g_len++;
  pthread_mutex_unlock(&g_lock);
  return ptr;
}

void sglang_symm_free(void* ptr, size_t size, int device, void* stream) {
  (void)size; (void)device; (void)stream;
  pthread_mutex_lock(&g_lock);
  for (size_t i = g_len; i > 0; --i) {
    if (g_log[i - 1].base == (uintptr_t)ptr && g_log[i - 1].live) { g_log[i - 1].live = 0; break; }
  }
  g_frees++;
  sglang_free_fn fn = g_free;
  pthread_mutex_unlock(&g_lock);
  if (fn != NULL) {
    int rc = fn(ptr);
    if (rc != 0) g_last_error = rc;
  }
}

size_t sglang_symm_num_segments(void) { return g_len; }
size_t sglang_symm_num_frees(void) { return g_frees; }
int sglang_symm_last_error(void) { return g_last_error; }

int sglang_symm_get_segment(size_t i, uintptr_t* base, size_t* size, int* device, int* live) {
  int ok = 0;
  pthread_mutex_lock(&g_lock);
  if (i < g_len) {
    *base = g_log[i].base; *size = g_log[i].size; *device = g_log[i].device; *live = g_log[i].live;
    ok = 1;
  }
  pthread_mutex_unlock(&g_lock);
  return ok;
}
"""

_SOURCE_TAG = hashlib.sha256(SHIM_SOURCE.encode()).hexdigest()[:16]


class ShimBuildError(RuntimeError):
    """The allocator shim could not be compiled."""


@dataclass(frozen=True)
class PoolSegment:
    """One allocation the shim handed to torch: ``index`` is its position in allocation order."""

    index: int
    base: int
    size: int
    device: int
    live: bool

    @property
    def end(self) -> int:
        return self.base + self.size


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "sglang"


def shim_filename() -> str:
    return f"libsglang_symm_alloc_{platform.machine()}_{_SOURCE_TAG}.so"


def build_shim(cache_dir: Path | None = None, compiler: str | None = None) -> Path:
    """Compile the shim once per machine and source version; return the ``.so`` path.

    Safe when several ranks call it at once: the build holds an exclusive lock on a side file,
    and writes to a temporary name that is renamed into place (readers never see a partial
    file)."""
    if cache_dir is None:
        cache_dir = default_cache_dir()
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError:  # read-only home: fall back to a per-user temp dir
            cache_dir = Path(tempfile.gettempdir()) / f"sglang-{os.getuid()}"
    cache_dir = Path(cache_dir)
    target = cache_dir / shim_filename()
    if target.is_file():
        return target
    cc = compiler or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise ShimBuildError(
            "no C compiler (gcc) found to build the symmetric-memory allocator shim; install gcc"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / (target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if target.is_file():  # another rank built it while we waited
                return target
            with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
                src = Path(tmp) / "shim.c"
                src.write_text(SHIM_SOURCE)
                out = Path(tmp) / "shim.so"
                cmd = [cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(src), "-lpthread"]
                proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise ShimBuildError(
                        f"building the allocator shim failed ({' '.join(cmd)}):\n{proc.stderr}"
                    )
                os.replace(out, target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


class SymmAllocShim:
    """ctypes view of a loaded shim: install the NCCL functions and read the segment log."""

    def __init__(self, path: str | Path) -> None:
        # Same path as CUDAPluggableAllocator will dlopen, so both see one copy of its globals.
        self.path = str(Path(path).resolve())
        lib = ctypes.CDLL(self.path)
        lib.sglang_symm_set_backend.restype = None
        lib.sglang_symm_set_backend.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.sglang_symm_alloc.restype = ctypes.c_void_p
        lib.sglang_symm_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.sglang_symm_free.restype = None
        lib.sglang_symm_free.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        lib.sglang_symm_num_segments.restype = ctypes.c_size_t
        lib.sglang_symm_num_segments.argtypes = []
        lib.sglang_symm_num_frees.restype = ctypes.c_size_t
        lib.sglang_symm_num_frees.argtypes = []
        lib.sglang_symm_last_error.restype = ctypes.c_int
        lib.sglang_symm_last_error.argtypes = []
        lib.sglang_symm_get_segment.restype = ctypes.c_int
        lib.sglang_symm_get_segment.argtypes = [
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_int),
        ]
        self._lib = lib

    def set_backend(self, alloc_fn_address: int, free_fn_address: int) -> None:
        """Point the hooks at ``int alloc(void**, size_t)`` / ``int free(void*)`` C functions."""
        self._lib.sglang_symm_set_backend(alloc_fn_address, free_fn_address)

    def alloc(self, size: int, device: int = 0) -> int:
        """Call the alloc hook directly (tests); 0 on failure."""
        return int(self._lib.sglang_symm_alloc(size, device, None) or 0)

    def free(self, ptr: int, size: int = 0, device: int = 0) -> None:
        self._lib.sglang_symm_free(ptr, size, device, None)

    def num_segments(self) -> int:
        return int(self._lib.sglang_symm_num_segments())

    def num_frees(self) -> int:
        return int(self._lib.sglang_symm_num_frees())

    def last_error(self) -> int:
        return int(self._lib.sglang_symm_last_error())

    def segments(self, start: int = 0) -> list[PoolSegment]:
        out: list[PoolSegment] = []
        base, size = ctypes.c_size_t(), ctypes.c_size_t()
        device, live = ctypes.c_int(), ctypes.c_int()
        i = start
        while self._lib.sglang_symm_get_segment(
            i, ctypes.byref(base), ctypes.byref(size), ctypes.byref(device), ctypes.byref(live)
        ):
            out.append(PoolSegment(i, base.value, size.value, device.value, bool(live.value)))
            i += 1
        return out


_shim: SymmAllocShim | None = None
_shim_lock = threading.Lock()


def get_shim(cache_dir: Path | None = None) -> SymmAllocShim:
    """The process's one shim (built on first use)."""
    global _shim
    with _shim_lock:
        if _shim is None:
            _shim = SymmAllocShim(build_shim(cache_dir))
        return _shim
