"""Which all-reduce a tensor takes: the symmetric path only when every condition holds."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sglang.srt.distributed import all_reduce_dispatch as ard
from sglang.srt.distributed.all_reduce_dispatch import AllReducePath, KiB, MiB
from sglang.srt.distributed.symm_mem import allocator as pa
from sglang.srt.environ import envs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_symm_mem import FakeGroup, FakeSymmetricPool
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)


@pytest.fixture(autouse=True)
def _state(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(pa, "require_nccl_version", lambda *a, **k: (2, 28, 9))
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    for knob in (envs.SGLANG_DEBUG_SYMM_MEM, envs.SGLANG_SYMM_MEM_ALL_REDUCE_POLICY):
        monkeypatch.delenv(knob.name, raising=False)
    pool = FakeSymmetricPool()
    pa.set_symmetric_pool(pool)
    ard._debug_seen.clear()
    yield pool
    pa.set_symmetric_memory_enabled(False)
    pa.shutdown_symmetric_memory()
    pa.set_symmetric_pool(None)


@pytest.fixture
def torch_all_reduce(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    calls: list[torch.Tensor] = []

    def record(x: torch.Tensor, group: Any = None, **kwargs: Any) -> None:
        calls.append(x)

    monkeypatch.setattr(dist, "all_reduce", record)
    return calls


def _in_pool(group: FakeGroup, nbytes: int) -> torch.Tensor:
    """A CPU buffer registered as a window on ``group``'s communicator."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    was = pa.is_symmetric_memory_enabled()
    pa.set_symmetric_memory_enabled(True)
    pool = pa.get_symmetric_pool()
    with pa.use_symmetric_memory(group):
        pool.alloc(nbytes, base=buf.data_ptr())  # type: ignore[attr-defined]
    pa.set_symmetric_memory_enabled(was)
    return buf


# --- the size table -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "wins"),
    [
        (2 * KiB, False),  # below anything measured
        (4 * KiB, True),
        (14 * KiB, True),  # 1 token x 7168 x bf16
        (16 * KiB, True),
        (32 * KiB, True),
        (48 * KiB - 2, True),
        (48 * KiB, False),
        (64 * KiB, False),
        (112 * KiB, False),
        (1 * MiB, False),
        (1536 * KiB - 2, False),
        (1536 * KiB, True),
        (2 * MiB, True),
        (7 * MiB, True),
        (4 * MiB, True),
        (8 * MiB, False),
        (16 * MiB, False),
        (64 * MiB, False),
    ],
)
def test_world2_table(nbytes: int, wins: bool) -> None:
    assert ard.symm_all_reduce_size_wins(nbytes, 2) is wins


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_default_for_unmeasured_world_sizes(world_size: int) -> None:
    assert ard.symm_all_reduce_size_wins(4 * KiB, world_size)
    assert ard.symm_all_reduce_size_wins(16 * KiB, world_size)
    assert not ard.symm_all_reduce_size_wins(16 * KiB + 2, world_size)
    assert not ard.symm_all_reduce_size_wins(2 * KiB, world_size)
    assert not ard.symm_all_reduce_size_wins(4 * MiB, world_size)


def test_table_is_immutable_data() -> None:
    with pytest.raises(TypeError):
        ard.SYMM_ALL_REDUCE_WIN_RANGES[2] = ()  # type: ignore[index]
    with pytest.raises(ValueError):
        ard.ByteRange(10, 10)


def test_policy_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(envs.SGLANG_SYMM_MEM_ALL_REDUCE_POLICY.name, "always")
    assert ard.symm_all_reduce_size_wins(64 * MiB, 2)
    monkeypatch.setenv(envs.SGLANG_SYMM_MEM_ALL_REDUCE_POLICY.name, "never")
    assert not ard.symm_all_reduce_size_wins(16 * KiB, 2)


# --- the truth table ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("enabled", "has_pynccl", "in_pool", "dtype_ok", "size_ok"),
    list(itertools.product([True, False], repeat=5)),
)
def test_dispatch_truth_table(
    enabled: bool,
    has_pynccl: bool,
    in_pool: bool,
    dtype_ok: bool,
    size_ok: bool,
    torch_all_reduce: list[torch.Tensor],
) -> None:
    nbytes = 16 * KiB if size_ok else 64 * KiB
    dtype = torch.bfloat16 if dtype_ok else torch.int32
    group = FakeGroup(world_size=2)
    raw = _in_pool(group, nbytes) if in_pool else torch.empty(nbytes, dtype=torch.uint8)
    x = raw.view(dtype)
    if not has_pynccl:
        group = FakeGroup(world_size=2, pynccl_comm=None)
    pa.set_symmetric_memory_enabled(enabled)

    expected = (
        AllReducePath.SYMMETRIC
        if enabled and has_pynccl and in_pool and dtype_ok and size_ok
        else AllReducePath.TORCH
    )
    assert ard.select_all_reduce_path(group, x) is expected

    out = ard.all_reduce(group, x)
    assert out is x, "both paths reduce in place"
    if expected is AllReducePath.SYMMETRIC:
        assert group.pynccl_comm.all_reduced == [x] and torch_all_reduce == []
    else:
        assert torch_all_reduce == [x]
        if has_pynccl:
            assert group.pynccl_comm.all_reduced == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_symmetric_dtypes(dtype: torch.dtype) -> None:
    group = FakeGroup()
    x = _in_pool(group, 8 * KiB).view(dtype)
    pa.set_symmetric_memory_enabled(True)
    assert ard.select_all_reduce_path(group, x) is AllReducePath.SYMMETRIC


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.int32, torch.uint8])
def test_unsupported_dtypes_take_regular_path(dtype: torch.dtype) -> None:
    group = FakeGroup()
    x = _in_pool(group, 8 * KiB).view(dtype)
    pa.set_symmetric_memory_enabled(True)
    assert ard.select_all_reduce_path(group, x) is AllReducePath.TORCH


def test_world_size_one_is_identity(torch_all_reduce: list[torch.Tensor]) -> None:
    group = FakeGroup(world_size=1)
    x = torch.ones(4)
    assert ard.select_all_reduce_path(group, x) is AllReducePath.IDENTITY
    assert ard.all_reduce(group, x) is x and torch_all_reduce == []


def test_non_contiguous_pool_view_takes_regular_path() -> None:
    group = FakeGroup()
    x = _in_pool(group, 16 * KiB).view(torch.float32).view(64, 64)[:, :32]
    pa.set_symmetric_memory_enabled(True)
    assert ard.select_all_reduce_path(group, x) is AllReducePath.TORCH


def test_compiling_takes_regular_path(monkeypatch: pytest.MonkeyPatch) -> None:
    group = FakeGroup()
    x = _in_pool(group, 16 * KiB).view(torch.bfloat16)
    pa.set_symmetric_memory_enabled(True)
    monkeypatch.setattr(ard, "_is_compiling", lambda: True)
    assert ard.select_all_reduce_path(group, x) is AllReducePath.TORCH


def test_other_groups_window_does_not_count() -> None:
    owner, other = FakeGroup(), FakeGroup()
    x = _in_pool(owner, 16 * KiB).view(torch.bfloat16)
    pa.set_symmetric_memory_enabled(True)
    assert ard.select_all_reduce_path(other, x) is AllReducePath.TORCH


# --- the debug switch -----------------------------------------------------------------------


def _call_site_a(group: FakeGroup, x: torch.Tensor) -> AllReducePath:
    return ard.select_all_reduce_path(group, x)


def _call_site_b(group: FakeGroup, x: torch.Tensor) -> AllReducePath:
    return ard.select_all_reduce_path(group, x)


def test_debug_logs_missed_pool_once_per_call_site(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    group = FakeGroup()
    pa.set_symmetric_memory_enabled(True)
    stray = torch.zeros(8 * KiB, dtype=torch.bfloat16)  # 16 KiB: in the table, not in the pool
    with caplog.at_level(logging.WARNING, logger=ard.logger.name):
        _call_site_a(group, stray)  # debug off: silent
        assert "not in the symmetric pool" not in caplog.text

        monkeypatch.setenv(envs.SGLANG_DEBUG_SYMM_MEM.name, "1")
        for _ in range(3):
            _call_site_a(group, stray)
        assert caplog.text.count("not in the symmetric pool") == 1
        assert "_call_site_a" in caplog.text, "the message names the call site"

        _call_site_b(group, stray)
        assert caplog.text.count("not in the symmetric pool") == 2

        pooled = _in_pool(group, 16 * KiB).view(torch.bfloat16)
        for quiet_group, quiet_x in (
            (FakeGroup(rank_in_group=1), stray),  # only group rank 0 logs
            (group, torch.zeros(32 * KiB, dtype=torch.bfloat16)),  # 64 KiB: not in the table
            (group, torch.zeros(8 * KiB, dtype=torch.int32)),  # dtype without symmetric kernels
            (group, pooled),  # in the pool
        ):
            caplog.clear()
            ard._debug_seen.clear()
            _call_site_a(quiet_group, quiet_x)
            assert "not in the symmetric pool" not in caplog.text


if __name__ == "__main__":
    run_this_file(__file__)
