"""NCCL symmetric memory on one GPU.

* the ctypes binding: version >= 2.27.3, the window symbols, ncclMemAlloc giving cuMem memory;
* the pool: tensors allocated inside its routing come from ncclMemAlloc segments (cuMem), the
  segment log matches, ``empty_cache`` does not release them;
* registration end to end on a one-rank communicator (NCCL registers windows there too): the
  context registers new segments once, a capture after an eager warm-up on the capture stream
  finds its tensor in a registered window, and a capture that needs a new segment is refused.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import pytest
import torch

from sglang.srt.distributed.device_communicators.pynccl_library import (
    SYMM_MEM_MIN_NCCL_VERSION,
    NcclError,
    get_nccl_library,
)
from sglang.srt.distributed.symm_mem import allocator as pa
from sglang.test.ci_register import register_cuda_ci
from sglang.test.multiprocess import run_distributed
from sglang.test.run import run_this_file
from sglang.test.symm_graph_capture import capture_in_graph_pool

register_cuda_ci(est_time=15, suite="h200-1gpu")

MiB = 1 << 20


def _cuda_driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemRetainAllocationHandle.restype = ctypes.c_int
    lib.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_void_p]
    lib.cuMemRelease.restype = ctypes.c_int
    lib.cuMemRelease.argtypes = [ctypes.c_ulonglong]
    return lib


def _is_cumem(ptr: int) -> bool:
    """cuMemRetainAllocationHandle succeeds only on cuMem (VMM) memory, which windows need."""
    driver = _cuda_driver()
    handle = ctypes.c_ulonglong()
    if driver.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)) != 0:
        return False
    driver.cuMemRelease(handle)
    return True


def _within(t: torch.Tensor, segments: list[tuple[int, int]]) -> bool:
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(base <= start and end <= base + size for base, size in segments)


@pytest.fixture(scope="module", autouse=True)
def _feature_on() -> Any:
    pa.set_symmetric_memory_enabled(True)  # sets NCCL_CUMEM_ENABLE=1 before our first NCCL call
    torch.zeros(1, device="cuda")  # a current context for the driver calls
    yield
    pa.set_symmetric_memory_enabled(False)


def test_binding_version_and_window_symbols() -> None:
    lib = get_nccl_library()
    assert lib.version() >= SYMM_MEM_MIN_NCCL_VERSION, f"NCCL {lib.version_string()} at {lib.path}"
    for name in (
        "ncclMemAlloc",
        "ncclMemFree",
        "ncclCommWindowRegister",
        "ncclCommWindowDeregister",
    ):
        assert lib.has(name), f"{lib.path} lacks {name}"
    with pytest.raises(NcclError, match="ncclInvalidArgument"):
        lib.check("ncclTest", 4)
    print(f"NCCL {lib.version_string()} from {lib.path}")


def test_nccl_mem_alloc_gives_cumem_memory() -> None:
    lib = get_nccl_library()
    ptr = lib.mem_alloc(4 * MiB)
    try:
        assert ptr != 0
        assert _is_cumem(ptr), "ncclMemAlloc did not return cuMem memory (NCCL_CUMEM_ENABLE?)"
    finally:
        lib.mem_free(ptr)


def test_pool_allocates_through_ncclmemalloc() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    pool = pa.get_symmetric_pool(device)
    start, frees = pool.num_segments(), pool.num_frees()
    with pool.route():
        big = torch.empty(3 * MiB, dtype=torch.uint8, device=device)
        small = torch.empty(1024, dtype=torch.uint8, device=device)
    outside = torch.empty(3 * MiB, dtype=torch.uint8, device=device)
    new = [(s.base, s.size) for s in pool.segments(start) if s.live]
    assert new, "no ncclMemAlloc segment was created"
    assert all(size % (2 * MiB) == 0 for _, size in new), new
    assert _within(big, new) and _within(small, new)
    assert not _within(outside, new)
    assert all(_is_cumem(base) for base, _ in new)
    big.fill_(7)
    assert int(big.sum(dtype=torch.int64)) == 7 * 3 * MiB
    assert set(new) <= set(pa.pool_segments(device))

    del big, small
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert pool.num_frees() == frees, "empty_cache must not release a live pool's segments"
    assert set(new) <= set(pa.pool_segments(device))


class _PretendTwoRanks:
    """The real one-rank TP group, claiming two ranks so ``use_symmetric_memory`` is active."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.world_size = 2
        self.rank_in_group = 0
        self.device = inner.device
        self.pynccl_comm = inner.pynccl_comm


def _one_rank_flow(rank: int, world_size: int) -> dict[str, Any]:
    from sglang.srt.distributed import parallel_state as ps

    tp = ps.initialize_model_parallel(1, use_pynccl=True)
    assert tp.pynccl_comm is not None
    group = _PretendTwoRanks(tp)
    device = tp.device
    out: dict[str, Any] = {"cumem_env": os.environ.get("NCCL_CUMEM_ENABLE")}

    with pa.use_symmetric_memory(group):
        x = torch.empty(8192, dtype=torch.bfloat16, device=device)  # 16 KiB
    assert pa.is_tensor_in_symmetric_pool(x, group)
    windows = pa.registered_windows(group)
    assert windows and set(windows) == set(pa.pool_segments(device)), (
        windows,
        pa.pool_segments(device),
    )
    with pa.use_symmetric_memory(group):
        y = torch.empty(8192, dtype=torch.bfloat16, device=device)
    assert pa.registered_windows(group) == windows, "a cached block needs no new window"
    assert pa.is_tensor_in_symmetric_pool(y, group)
    x.fill_(3.0)
    tp.pynccl_comm.all_reduce(x)
    torch.cuda.synchronize()
    assert bool((x == 3.0).all()), "a one-rank all-reduce returns its input"

    # Capture after an eager warm-up on the capture stream: no registration during capture.
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            with pa.use_symmetric_memory(group):
                w = torch.empty(4096, dtype=torch.bfloat16, device=device)
            w.fill_(1.0)
            tp.pynccl_comm.all_reduce(w)
            del w
    torch.cuda.synchronize()
    before = pa.registered_windows(group)
    graph = torch.cuda.CUDAGraph()
    with capture_in_graph_pool(graph, stream):
        with pa.use_symmetric_memory(group):
            z = torch.empty(4096, dtype=torch.bfloat16, device=device)
        z_in_pool = pa.is_tensor_in_symmetric_pool(z, group)
        z.fill_(2.0)
        tp.pynccl_comm.all_reduce(z)
    assert z_in_pool, "the captured allocation did not land in a registered window"
    assert pa.registered_windows(group) == before
    graph.replay()
    torch.cuda.synchronize()
    assert bool((z == 2.0).all())
    out["captured_in_pool"] = z_in_pool

    # A capture that needs a new segment is refused with the warm-up advice.
    refused = ""
    graph2 = torch.cuda.CUDAGraph()
    try:
        with capture_in_graph_pool(graph2, stream):  # noqa: SIM117
            with pa.use_symmetric_memory(group):
                torch.empty(48 * MiB, dtype=torch.uint8, device=device)
    except pa.SymmetricMemoryError as exc:
        refused = str(exc)
    assert "capturing" in refused and "Warm up" in refused, refused
    torch.cuda.synchronize()
    with pa.use_symmetric_memory(group):
        pass  # the segment made during the refused capture is registered now, eagerly
    assert len(pa.registered_windows(group)) == len(before) + 1
    out["windows"] = len(pa.registered_windows(group))
    return out  # teardown (deregister, close, destroy) runs in the helper and must not abort


def test_registration_end_to_end_on_one_rank() -> None:
    (result,) = run_distributed(
        _one_rank_flow, 1, backend="nccl", enable_symm_mem=True, timeout_s=300
    )
    assert result["cumem_env"] == "1"
    assert result["captured_in_pool"] is True
    assert result["windows"] >= 2


if __name__ == "__main__":
    run_this_file(__file__)
