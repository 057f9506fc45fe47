"""The symmetric pool's bookkeeping on CPU, with a fake pool and communicator; the NCCL binding's
version handling; the allocator shim compiled with gcc and driven by fake NCCL functions."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import threading
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from sglang.srt.distributed.device_communicators import pynccl_library as nl
from sglang.srt.distributed.symm_mem import allocator as pa
from sglang.srt.distributed.symm_mem.alloc_shim import (
    SymmAllocShim,
    build_shim,
    shim_filename,
)
from sglang.srt.distributed.symm_mem.windows import WindowRanges
from sglang.srt.environ import envs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_symm_mem import FakeGroup, FakeSymmetricPool, FakeWindowComm
from sglang.test.run import run_this_file

register_cpu_ci(est_time=5)

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    monkeypatch.delenv(envs.SGLANG_DEBUG_SYMM_MEM.name, raising=False)
    monkeypatch.delenv(envs.SGLANG_SYMM_MEM_PREALLOC_GB_SIZE.name, raising=False)
    yield
    pa.set_symmetric_memory_enabled(False)
    pa.shutdown_symmetric_memory()
    pa.set_symmetric_pool(None)
    pa.set_graph_pool_id(None)


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> FakeSymmetricPool:
    """Feature on (NCCL version check faked), fake pool installed."""
    monkeypatch.setattr(pa, "require_nccl_version", lambda *a, **k: (2, 28, 9))
    pa.set_symmetric_memory_enabled(True)
    fake = FakeSymmetricPool()
    pa.set_symmetric_pool(fake)
    return fake


# --- when the context is a no-op ------------------------------------------------------------


def test_nullcontext_when_feature_off() -> None:
    assert not pa.is_symmetric_memory_enabled()
    assert isinstance(pa.use_symmetric_memory(FakeGroup()), nullcontext)


def test_nullcontext_conditions(pool: FakeSymmetricPool) -> None:
    assert isinstance(pa.use_symmetric_memory(FakeGroup(), disabled=True), nullcontext)
    assert isinstance(pa.use_symmetric_memory(None), nullcontext)
    assert isinstance(pa.use_symmetric_memory(FakeGroup(world_size=1)), nullcontext)
    assert isinstance(pa.use_symmetric_memory(FakeGroup(pynccl_comm=None)), nullcontext)
    assert isinstance(pa.use_symmetric_memory(lambda: None), nullcontext)
    assert not isinstance(pa.use_symmetric_memory(FakeGroup()), nullcontext)
    assert not isinstance(pa.use_symmetric_memory(lambda: FakeGroup()), nullcontext)


def test_group_callable_not_called_when_disabled(pool: FakeSymmetricPool) -> None:
    def boom() -> FakeGroup:
        raise AssertionError("group looked up although the site is disabled")

    assert isinstance(pa.use_symmetric_memory(boom, disabled=True), nullcontext)
    pa.set_symmetric_memory_enabled(False)
    assert isinstance(pa.use_symmetric_memory(boom), nullcontext)


# --- registration bookkeeping ---------------------------------------------------------------


def test_registers_new_segments_once_in_order(pool: FakeSymmetricPool) -> None:
    group = FakeGroup()
    comm = group.pynccl_comm
    with pa.use_symmetric_memory(group):
        assert pool.routing
        a = pool.alloc(2 * MiB)
        b = pool.alloc(20 * MiB)
        assert comm.registered == [], "registration happens at exit, not at allocation"
    assert not pool.routing
    assert comm.registered == [(a.base, a.size), (b.base, b.size)]

    with pa.use_symmetric_memory(group):
        pass  # cached blocks reused: nothing new
    assert len(comm.registered) == 2

    with pa.use_symmetric_memory(group):
        c = pool.alloc(64 * MiB)
    assert comm.registered[2:] == [(c.base, c.size)]
    assert pa.registered_windows(group) == sorted(
        [(a.base, a.size), (b.base, b.size), (c.base, c.size)]
    )
    assert pa.pool_segments() == [(a.base, a.size), (b.base, b.size), (c.base, c.size)]


def test_each_communicator_registers_every_segment_once(pool: FakeSymmetricPool) -> None:
    g1, g2 = FakeGroup(), FakeGroup()
    with pa.use_symmetric_memory(g1):
        a = pool.alloc(2 * MiB)
    with pa.use_symmetric_memory(g2):
        b = pool.alloc(4 * MiB)
    with pa.use_symmetric_memory(g1):
        pass
    assert g1.pynccl_comm.registered == [(a.base, a.size), (b.base, b.size)]
    assert g2.pynccl_comm.registered == [(a.base, a.size), (b.base, b.size)]


def test_freed_segments_are_not_registered(pool: FakeSymmetricPool) -> None:
    group = FakeGroup()
    with pa.use_symmetric_memory(group):
        a = pool.alloc(2 * MiB)
        b = pool.alloc(2 * MiB)
        pool.free(a.base)
    assert group.pynccl_comm.registered == [(b.base, b.size)]


def test_segment_freed_while_registered_leaves_the_lookup(
    pool: FakeSymmetricPool, caplog: pytest.LogCaptureFixture
) -> None:
    group = FakeGroup()
    t = torch.zeros(64)
    with pa.use_symmetric_memory(group):
        pool.alloc(t.numel() * t.element_size(), base=t.data_ptr())
    assert pa.is_tensor_in_symmetric_pool(t, group)
    pool.free(t.data_ptr())
    with caplog.at_level(logging.ERROR), pa.use_symmetric_memory(group):
        pass
    assert "freed while registered" in caplog.text
    assert not pa.is_tensor_in_symmetric_pool(t, group)
    assert pa.release_symmetric_windows(group) == 1, "its handle is still deregistered"


def test_null_window_is_not_treated_as_symmetric(
    pool: FakeSymmetricPool, caplog: pytest.LogCaptureFixture
) -> None:
    group = FakeGroup(pynccl_comm=FakeWindowComm(null_windows=True))
    t = torch.zeros(16)
    with caplog.at_level(logging.WARNING), pa.use_symmetric_memory(group):
        pool.alloc(t.numel() * 4, base=t.data_ptr())
    assert group.pynccl_comm.registered, "registration was attempted"
    assert not pa.is_tensor_in_symmetric_pool(t, group)


def test_registration_refused_while_capturing(pool: FakeSymmetricPool) -> None:
    group = FakeGroup()
    pa.set_graph_pool_id((7, 1))
    pool.capturing = True
    with pytest.raises(pa.SymmetricMemoryError, match=r"capturing[\s\S]*Warm up"):  # noqa: SIM117
        with pa.use_symmetric_memory(group):
            seg = pool.alloc(2 * MiB)
    assert group.pynccl_comm.registered == []
    assert not pool.routing, "the pool routing ended before the error"
    assert pool.events == [
        ("pause_graph_pool", (7, 1)),
        ("route_enter", None),
        ("route_exit", None),
        ("resume_graph_pool", (7, 1)),
    ], "the graph pool is paused for the body and restored after"
    # After capture, the next eager exit registers the pending segment.
    pool.capturing = False
    with pa.use_symmetric_memory(group):
        pass
    assert group.pynccl_comm.registered == [(seg.base, seg.size)]


def test_capture_after_warmup_needs_no_registration(pool: FakeSymmetricPool) -> None:
    group = FakeGroup()
    with pa.use_symmetric_memory(group):  # eager warm-up creates and registers the segment
        pool.alloc(2 * MiB)
    pool.capturing = True
    with pa.use_symmetric_memory(group):  # capture reuses the cached block
        pass
    assert len(group.pynccl_comm.registered) == 1


def test_failing_body_does_not_register(pool: FakeSymmetricPool) -> None:
    group = FakeGroup()
    with pytest.raises(ValueError, match="body"):  # noqa: SIM117
        with pa.use_symmetric_memory(group):
            pool.alloc(2 * MiB)
            raise ValueError("body failed")
    assert group.pynccl_comm.registered == []
    assert not pool.routing
    assert pa.active_symmetric_memory_context() is None


def test_nested_contexts_route_once(pool: FakeSymmetricPool) -> None:
    outer_group, inner_group = FakeGroup(), FakeGroup()
    with pa.use_symmetric_memory(outer_group):
        with pa.use_symmetric_memory(inner_group):  # the fake raises if routed twice
            seg = pool.alloc(2 * MiB)
        assert pool.routing, "the outer context still routes after the inner one exits"
        assert inner_group.pynccl_comm.registered == [(seg.base, seg.size)]
    assert not pool.routing
    assert outer_group.pynccl_comm.registered == [(seg.base, seg.size)]


def test_suspend_and_restore(pool: FakeSymmetricPool) -> None:
    group = FakeGroup()
    with pa.suspend_symmetric_memory():  # nothing active: a no-op
        assert not pool.routing
    with pa.use_symmetric_memory(group) as ctx:
        assert pa.active_symmetric_memory_context() is ctx
        with pa.suspend_symmetric_memory():
            assert not pool.routing, "rank-local work goes to the default allocator"
            with pytest.raises(AssertionError):
                pool.alloc(2 * MiB)
        assert pool.routing
        seg = pool.alloc(2 * MiB)
    assert group.pynccl_comm.registered == [(seg.base, seg.size)]
    assert pa.active_symmetric_memory_context() is None


def test_suspend_restores_after_an_error(pool: FakeSymmetricPool) -> None:
    with pa.use_symmetric_memory(FakeGroup()):
        with pytest.raises(KeyError):  # noqa: SIM117
            with pa.suspend_symmetric_memory():
                raise KeyError("x")
        assert pool.routing


def test_debug_check_catches_asymmetric_allocations(
    pool: FakeSymmetricPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(envs.SGLANG_DEBUG_SYMM_MEM.name, "1")
    group = FakeGroup(gathered=[[2 * MiB], []])
    with pytest.raises(pa.SymmetricMemoryError, match="differ across ranks"):  # noqa: SIM117
        with pa.use_symmetric_memory(group):
            pool.alloc(2 * MiB)
    assert group.pynccl_comm.registered == []


def test_release_deregisters_every_window_in_registration_order(pool: FakeSymmetricPool) -> None:
    group = FakeGroup()
    with pa.use_symmetric_memory(group):
        pool.alloc(2 * MiB, base=0x9000_0000)
        pool.alloc(4 * MiB, base=0x1000_0000)  # lower address, registered second
    assert pa.release_symmetric_windows(group) == 2
    assert group.pynccl_comm.deregistered == [1, 2], "rank-uniform order, not address order"
    assert pa.registered_windows(group) == []
    assert pa.release_symmetric_windows(group) == 0


def test_shutdown_releases_windows_then_closes_pools(pool: FakeSymmetricPool) -> None:
    group = FakeGroup()
    with pa.use_symmetric_memory(group):
        pool.alloc(2 * MiB)
    pa.set_symmetric_pool(None)
    real_pools = pa._state.pools
    real_pools[0] = pool  # as if it were the device's real pool
    pa.shutdown_symmetric_memory()
    assert group.pynccl_comm.deregistered == [1]
    assert pool.closed and pa._state.pools == {}


def test_prealloc(pool: FakeSymmetricPool, monkeypatch: pytest.MonkeyPatch) -> None:
    group = FakeGroup()
    assert pa.prealloc_symmetric_memory_pool(group, gib=0) == 0
    assert pa.prealloc_symmetric_memory_pool(FakeGroup(world_size=1), gib=1) == 0
    monkeypatch.setenv(envs.SGLANG_SYMM_MEM_PREALLOC_GB_SIZE.name, "0.001")
    enters = len([e for e in pool.events if e[0] == "route_enter"])
    assert pa.prealloc_symmetric_memory_pool(group) == 2 * MiB, "rounded up to 2 MiB"
    assert len([e for e in pool.events if e[0] == "route_enter"]) == enters + 1
    with pytest.raises(ValueError):
        pa.prealloc_symmetric_memory_pool(group, gib=-1)


def test_prealloc_is_noop_when_feature_off() -> None:
    assert pa.prealloc_symmetric_memory_pool(FakeGroup(), gib=1) == 0


# --- range lookup ---------------------------------------------------------------------------


def test_window_ranges_lookup() -> None:
    r = WindowRanges()
    r.add(0x3000, 0x1000, 3)
    r.add(0x1000, 0x1000, 1)
    assert [w.base for w in r.windows()] == [0x1000, 0x3000], "kept sorted"
    assert r.contains(0x1000, 1)  # first byte
    assert r.contains(0x1000, 0x1000)  # exactly the window
    assert r.contains(0x1FFF, 1)  # last byte
    assert not r.contains(0x1FFF, 2)  # runs past the end
    assert not r.contains(0x2000, 1)  # the gap
    assert not r.contains(0x0FFF, 1)  # before the first
    assert not r.contains(0x1800, 0x1000)  # straddles a window and the gap
    assert not r.contains(0x4000, 1)  # after the last
    assert not r.contains(0x1000, 0)  # empty buffers never count
    assert r.find(0x3800, 16).handle == 3
    with pytest.raises(ValueError, match="overlaps"):
        r.add(0x1800, 0x1000)
    with pytest.raises(ValueError, match="overlaps"):
        r.add(0x2800, 0x1000)
    r.add(0x2000, 0x1000)  # exactly fills the gap
    assert len(r) == 3


def test_is_tensor_in_symmetric_pool(pool: FakeSymmetricPool) -> None:
    group, other = FakeGroup(), FakeGroup()
    buf = torch.zeros(1024, dtype=torch.float32)
    outside = torch.zeros(8)
    assert not pa.is_tensor_in_symmetric_pool(buf), "nothing registered yet"
    with pa.use_symmetric_memory(group):
        pool.alloc(4096, base=buf.untyped_storage().data_ptr())
    assert pa.is_tensor_in_symmetric_pool(buf, group)
    assert pa.is_tensor_in_symmetric_pool(buf)  # any communicator
    assert pa.is_tensor_in_symmetric_pool(buf[100:200], group)  # a view at an offset
    assert pa.is_tensor_in_symmetric_pool(buf[1023:], group)  # the last element
    assert pa.is_tensor_in_symmetric_pool(buf.view(32, 32)[:, :4], group)  # strided view
    assert not pa.is_tensor_in_symmetric_pool(buf[:0], group)
    assert not pa.is_tensor_in_symmetric_pool(outside, group)
    assert not pa.is_tensor_in_symmetric_pool(buf, other), "other group's comm has no window"
    assert not pa.is_tensor_in_symmetric_pool(buf, FakeGroup(pynccl_comm=None))
    # a tensor that starts inside but runs past the window
    big = torch.zeros(2048)
    with pa.use_symmetric_memory(other):
        pool.alloc(1024, base=big.data_ptr())
    assert pa.is_tensor_in_symmetric_pool(big[:256], other)
    assert not pa.is_tensor_in_symmetric_pool(big[:257], other)
    assert not pa.is_tensor_in_symmetric_pool(big, other)


# --- enabling and the NCCL version ----------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "version"),
    [
        (22809, (2, 28, 9)),
        (22703, (2, 27, 3)),
        (21903, (2, 19, 3)),
        (23007, (2, 30, 7)),
        (2708, (2, 7, 8)),
    ],
)
def test_parse_nccl_version(code: int, version: tuple[int, int, int]) -> None:
    assert nl.parse_nccl_version(code) == version


def test_require_nccl_version() -> None:
    assert nl.require_nccl_version((2, 27, 3), "--enable-symm-mem", found=(2, 28, 9)) == (2, 28, 9)
    assert nl.require_nccl_version((2, 27, 3), "--enable-symm-mem", found=(2, 27, 3)) == (2, 27, 3)
    with pytest.raises(RuntimeError) as info:
        nl.require_nccl_version((2, 27, 3), "--enable-symm-mem", found=(2, 26, 2))
    message = str(info.value)
    assert "--enable-symm-mem" in message and "2.27.3" in message and "found 2.26.2" in message


def test_missing_library_is_reported_not_raised_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(envs.SGLANG_NCCL_SO_PATH.name, "/nonexistent/libnccl.so.2")
    with pytest.raises(nl.NcclUnavailableError, match="SGLANG_NCCL_SO_PATH"):
        nl.find_nccl_library()
    with pytest.raises(nl.NcclUnavailableError, match="cannot load NCCL"):
        nl.NcclLibrary("/nonexistent/libnccl.so.2")


def test_require_version_when_library_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable() -> tuple[int, int, int]:
        raise nl.NcclUnavailableError("no libnccl.so.2 here")

    monkeypatch.setattr(nl, "nccl_version", unavailable)
    with pytest.raises(nl.NcclUnavailableError, match="--enable-symm-mem needs NCCL >= 2.27.3"):
        nl.require_nccl_version((2, 27, 3), "--enable-symm-mem")


def test_nccl_unique_id_round_trip() -> None:
    raw = bytes(range(128))
    assert nl.NcclUniqueId.from_bytes(raw).to_bytes() == raw
    with pytest.raises(ValueError):
        nl.NcclUniqueId.from_bytes(b"short")


def _fake_version(found: tuple[int, int, int]):
    def check(minimum: tuple[int, int, int], feature: str) -> tuple[int, int, int]:
        return nl.require_nccl_version(minimum, feature, found=found)

    return check


def test_enabling_sets_cumem_and_never_nvls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pa, "require_nccl_version", _fake_version((2, 28, 9)))
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    pa.set_symmetric_memory_enabled(True)
    assert pa.is_symmetric_memory_enabled()
    assert os.environ["NCCL_CUMEM_ENABLE"] == "1"
    assert "NCCL_NVLS_ENABLE" not in os.environ
    pa.set_symmetric_memory_enabled(False)
    assert not pa.is_symmetric_memory_enabled()

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    pa.set_symmetric_memory_enabled(True)
    assert os.environ["NCCL_CUMEM_ENABLE"] == "1"
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


def test_enabling_with_old_nccl_fails_and_restores_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pa, "require_nccl_version", _fake_version((2, 26, 2)))
    with pytest.raises(RuntimeError, match=r"NCCL >= 2\.27\.3, found 2\.26\.2"):
        pa.set_symmetric_memory_enabled(True)
    assert not pa.is_symmetric_memory_enabled()
    assert "NCCL_CUMEM_ENABLE" not in os.environ
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    with pytest.raises(RuntimeError):
        pa.set_symmetric_memory_enabled(True)
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0"


# --- the C shim -----------------------------------------------------------------------------

ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
FREE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@needs_gcc
def test_shim_build_is_cached_and_concurrency_safe(tmp_path: Path) -> None:
    paths: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            paths.append(build_shim(tmp_path))
        except BaseException as exc:  # noqa: BLE001  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(paths)) == 1 and paths[0].name == shim_filename()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".so") == [shim_filename()]
    mtime = paths[0].stat().st_mtime_ns
    assert build_shim(tmp_path) == paths[0] and paths[0].stat().st_mtime_ns == mtime


@needs_gcc
def test_shim_records_segments_through_fake_nccl(tmp_path: Path) -> None:
    shim = SymmAllocShim(build_shim(tmp_path))
    assert shim.alloc(4096) == 0 and shim.last_error() == -1, "no backend installed yet"

    allocated: list[tuple[int, int]] = []
    freed: list[int] = []
    next_addr = [0x10_0000_0000]

    @ALLOC_FN
    def fake_alloc(out, size):  # type: ignore[no-untyped-def]
        if size == 12345:
            return 2  # ncclSystemError
        out[0] = next_addr[0]
        allocated.append((next_addr[0], size))
        next_addr[0] += size
        return 0

    @FREE_FN
    def fake_free(ptr):  # type: ignore[no-untyped-def]
        freed.append(ptr)
        return 0

    shim.set_backend(
        ctypes.cast(fake_alloc, ctypes.c_void_p).value,
        ctypes.cast(fake_free, ctypes.c_void_p).value,
    )
    a = shim.alloc(2 * MiB, device=0)
    b = shim.alloc(20 * MiB, device=1)
    assert (a, b) == (allocated[0][0], allocated[1][0])
    assert shim.alloc(12345) == 0 and shim.last_error() == 2, "an NCCL failure is a NULL alloc"
    segs = shim.segments()
    assert [(s.index, s.base, s.size, s.device, s.live) for s in segs] == [
        (0, a, 2 * MiB, 0, True),
        (1, b, 20 * MiB, 1, True),
    ]
    assert shim.num_segments() == 2 and shim.num_frees() == 0
    shim.free(a, 2 * MiB, 0)
    assert freed == [a] and shim.num_frees() == 1
    assert [s.live for s in shim.segments()] == [False, True]
    assert [s.index for s in shim.segments(1)] == [1]
    for _ in range(100):  # grows the log past its first capacity
        shim.alloc(4096)
    assert shim.num_segments() == 102


if __name__ == "__main__":
    run_this_file(__file__)
