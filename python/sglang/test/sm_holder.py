"""Hold whole SMs with a kernel on another stream (GPU tests and benchmarks of the reserved-SM
control).

Each holder CTA asks for 200 KB of shared memory, more than half of a Hopper SM's 228 KB, so no
other CTA that needs shared memory (any GEMM tile) can share its SM: ``n`` holder CTAs take ``n``
whole SMs for ``hold_ms``. Built with CuPy's runtime compiler (present on the GPU machines);
callers skip when CuPy is missing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from sglang.kernels.ops.grid_barrier import wait_for_count

_SMEM_BYTES = 200 * 1024
_SOURCE = r"""
extern "C" __global__ void hold_sm(unsigned long long hold_ns, int* started) {
    extern __shared__ volatile char smem[];
    if (threadIdx.x == 0) atomicAdd(started, 1);
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    t = t0;
    while (t - t0 < hold_ns) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        smem[threadIdx.x] = (char)t;
    }
}
"""


def cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # not installed, or no CUDA runtime
        return False
    return True


@functools.cache
def _kernel() -> Any:
    import cupy

    k = cupy.RawKernel(_SOURCE, "hold_sm")
    k.max_dynamic_shared_size_bytes = _SMEM_BYTES
    return k


def hold_sms(
    num_sms: int, hold_ms: float, side: torch.cuda.Stream, device: torch.device
) -> torch.Tensor:
    """Start ``num_sms`` holder CTAs on ``side``; the current stream waits (bounded) until all are
    resident, so work launched next really runs beside them. Returns their started counter."""
    import cupy
    import numpy

    started = torch.zeros(1, dtype=torch.int32, device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with cupy.cuda.Device(device.index or 0), cupy.cuda.ExternalStream(side.cuda_stream):
        _kernel()(
            (num_sms,),
            (256,),
            (numpy.uint64(int(hold_ms * 1e6)), numpy.uint64(started.data_ptr())),
            shared_mem=_SMEM_BYTES,
        )
    wait_for_count(started, num_sms, hold_ms)
    return started
