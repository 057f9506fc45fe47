"""Which mHC backend a call takes (SGLANG_MHC_BACKEND, whether tilelang / triton import, CPU vs
CUDA), the one-time log line, the routing of pre / fused post+pre to the TileLang functions with
the symmetric-pool rule intact, all on CPU with a fake ``tilelang`` module and stand-in CUDA
tensors; and, where tilelang and nvcc are installed, that the TileLang kernels lower and compile
for sm_90a."""

from __future__ import annotations

import logging
import shutil
import sys
import types
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch

from sglang.kernels.ops.layernorm import mhc_tilelang, mhc_triton
from sglang.kernels.ops.layernorm.mhc_params import MhcParams
from sglang.srt.distributed.symm_mem import output_scope
from sglang.srt.environ import EnvValueError, envs
from sglang.srt.layers import mhc
from sglang.test.alloc_recorder import SymmetricScopeRecorder
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=30)

ENV = "SGLANG_MHC_BACKEND"
E = MhcParams(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)


class _CudaLike:
    """Just what ``select_backend`` reads from a residual, claiming to live on a GPU."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.is_cuda = True
        self.device = torch.device("cuda", 0)

    def dim(self) -> int:
        return len(self.shape)


def _cuda_residual(shape: tuple[int, ...] = (3, 4, 64), **kw: Any) -> torch.Tensor:
    return cast(torch.Tensor, _CudaLike(shape, **kw))


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(mhc, "_HAS_TRITON", True)
    # Each test decides whether tilelang imports; the per-key decisions built on that go too.
    mhc.reset_backend_selection()
    yield
    mhc.reset_backend_selection()


def _fake_tilelang(monkeypatch: pytest.MonkeyPatch, version: str = "9.9.9-fake") -> None:
    module = types.ModuleType("tilelang")
    module.__version__ = version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tilelang", module)


def _no_tilelang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tilelang", None)  # "import tilelang" raises ImportError


@pytest.mark.parametrize("value", ["auto", "tilelang", "triton", "torch"])
def test_cpu_tensors_always_take_torch(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    _no_tilelang(monkeypatch)  # even an explicit tilelang does not raise for CPU tensors
    monkeypatch.setenv(ENV, value)
    backend, why = mhc.select_backend(torch.zeros(2, 4, 8))
    assert backend == "torch" and "cpu" in why


def test_auto_prefers_triton_even_when_tilelang_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_tilelang(monkeypatch)
    backend, why = mhc.select_backend(_cuda_residual())
    assert backend == "triton" and f"{ENV}=auto" in why and "faster" in why
    # auto with Triton never pays for importing tilelang (seconds)
    assert mhc._tilelang_import_error.cache_info().currsize == 0


def test_auto_falls_back_to_tilelang_then_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mhc, "_HAS_TRITON", False)
    _fake_tilelang(monkeypatch)
    backend, why = mhc.select_backend(_cuda_residual())
    assert backend == "tilelang" and "triton does not import" in why and "9.9.9-fake" in why
    mhc.reset_backend_selection()
    _no_tilelang(monkeypatch)
    backend, why = mhc.select_backend(_cuda_residual())
    assert backend == "torch" and "neither triton nor tilelang" in why and "halted" in why


def test_explicit_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_tilelang(monkeypatch)
    for value in ("tilelang", "triton", "torch"):
        monkeypatch.setenv(ENV, value)
        backend, why = mhc.select_backend(_cuda_residual())
        assert backend == value and f"{ENV}={value}" in why


def test_explicit_backend_that_cannot_run_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_tilelang(monkeypatch)
    monkeypatch.setenv(ENV, "tilelang")
    with pytest.raises(RuntimeError, match=f"{ENV}=tilelang but tilelang does not import"):
        mhc.select_backend(_cuda_residual())
    monkeypatch.setenv(ENV, "triton")
    monkeypatch.setattr(mhc, "_HAS_TRITON", False)
    with pytest.raises(RuntimeError, match=f"{ENV}=triton but triton does not import"):
        mhc.select_backend(_cuda_residual())


def test_unsupported_shape_or_dtype_takes_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_tilelang(monkeypatch)
    monkeypatch.setenv(ENV, "tilelang")  # not an error: the kernels simply do not cover these
    assert mhc.select_backend(_cuda_residual((3, 2, 64)))[0] == "torch"
    assert mhc.select_backend(_cuda_residual(dtype=torch.float64))[0] == "torch"


@pytest.mark.parametrize("raw", ["TileLang", "cuda", "", "auto "])
def test_bad_value_names_variable_and_value(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(EnvValueError) as info:
        mhc.select_backend(_cuda_residual())
    assert ENV in str(info.value) and repr(raw) in str(info.value)
    assert envs.SGLANG_MHC_BACKEND.default == "auto"


def test_choice_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    version = f"fake-{uuid.uuid4().hex}"  # a message no earlier test can have logged
    _fake_tilelang(monkeypatch, version)
    monkeypatch.setenv(ENV, "tilelang")
    with caplog.at_level(logging.INFO, logger="sglang"):
        for _ in range(3):
            assert mhc._backend(_cuda_residual()) == "tilelang"
    lines = [r.getMessage() for r in caplog.records if "mHC kernels" in r.getMessage()]
    assert lines == [f"mHC kernels: tilelang ({ENV}=tilelang, tilelang {version} imports)"]


def test_decision_is_cached_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """_backend decides once per (env value, device, supported, triton) key; a new key decides
    again, and reset_backend_selection forgets every decision."""
    _no_tilelang(monkeypatch)
    assert mhc._backend(_cuda_residual()) == "triton"
    calls: list[str] = []
    select = mhc.select_backend

    def counting(residual: torch.Tensor) -> tuple[str, str]:
        calls.append("select")
        return select(residual)

    monkeypatch.setattr(mhc, "select_backend", counting)
    assert mhc._backend(_cuda_residual((7, 4, 128))) == "triton" and calls == []
    monkeypatch.setattr(mhc, "_HAS_TRITON", False)
    assert mhc._backend(_cuda_residual()) == "torch" and calls == ["select"]
    monkeypatch.setenv(ENV, "torch")
    assert mhc._backend(_cuda_residual()) == "torch" and calls == ["select"] * 2
    mhc.reset_backend_selection()
    assert mhc._backend(_cuda_residual()) == "torch" and calls == ["select"] * 3


def test_tilelang_is_imported_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_tilelang(monkeypatch)
    assert mhc._tilelang_import_error() is None
    _no_tilelang(monkeypatch)
    assert mhc._tilelang_import_error() is None  # cached: no re-import per call


# ----------------------------------------------------------------------------- routing


def _symmetric_recorder(monkeypatch: pytest.MonkeyPatch) -> SymmetricScopeRecorder:
    rec = SymmetricScopeRecorder()
    monkeypatch.setattr(output_scope, "use_symmetric_memory", rec)
    monkeypatch.setattr(output_scope, "is_allocation_symmetric", lambda: True)
    monkeypatch.setattr(output_scope, "get_tp_group_or_none", lambda: None)
    return rec


def test_tilelang_backend_routes_pre_and_fused_with_symmetric_layer_input(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the TileLang backend chosen, mhc_pre / mhc_fused_post_pre call the TileLang functions
    with ``out`` allocated in the symmetric scope (and nothing else there); mhc_post takes
    Triton."""
    t, h = 3, 64
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(t, 4, h, generator=gen).bfloat16()
    x = torch.randn(t, h, generator=gen).bfloat16()
    p = (torch.randn(24, 4 * h, generator=gen) * 0.05, torch.rand(3) + 0.5, torch.randn(24))
    calls: list[str] = []

    def fake_pre(
        residual: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        out: torch.Tensor,
        params: MhcParams,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append("pre")
        assert out.shape == (t, h) and out.dtype == residual.dtype
        out.fill_(1.0)
        return torch.zeros(t, 4), torch.zeros(t, 4, 4)

    def fake_fused(
        residual: torch.Tensor,
        x_: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        new_residual: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        out: torch.Tensor,
        params: MhcParams,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append("fused")
        out.fill_(2.0)
        return torch.zeros(t, 4), torch.zeros(t, 4, 4)

    monkeypatch.setattr(mhc_tilelang, "mhc_pre_tilelang", fake_pre)
    monkeypatch.setattr(mhc_tilelang, "mhc_fused_post_pre_tilelang", fake_fused)
    monkeypatch.setattr(mhc, "_backend", lambda residual: "tilelang")
    post_calls: list[str] = []

    def fake_post(*args: torch.Tensor) -> torch.Tensor:
        post_calls.append("post")
        return torch.empty_like(r)

    monkeypatch.setattr(mhc_triton, "mhc_post_triton", fake_post)

    rec = _symmetric_recorder(monkeypatch)
    y, post, comb = mhc.mhc_pre(r, *p, E)
    assert calls == ["pre"] and bool((y == 1).all())
    assert rec.allocated == [y.untyped_storage().data_ptr()] and rec.entered == [(None, False)]

    rec = _symmetric_recorder(monkeypatch)
    nr, y2, post2, comb2 = mhc.mhc_fused_post_pre(x, r, post, comb, *p, E)
    assert calls == ["pre", "fused"] and bool((y2 == 2).all())
    assert rec.allocated == [y2.untyped_storage().data_ptr()]
    assert not {o.untyped_storage().data_ptr() for o in (nr, post2, comb2)} & set(rec.allocated)

    mhc.mhc_post(x, r, post, comb)
    assert post_calls == ["post"]


def test_mix_config_buckets() -> None:
    # Three buckets only (each a compiled kernel), chunks whole tiles, never wider than H.
    seen = {mhc_tilelang.mix_config(t, 7168) for t in (1, 2, 8, 9, 100, 256, 257, 5000)}
    assert len(seen) == 3
    for block_t, chunk in seen:
        assert block_t % 4 == 0 and chunk % mhc_tilelang.BLOCK_D == 0
    assert mhc_tilelang.mix_config(1000, 96)[1] == 2 * mhc_tilelang.BLOCK_D  # H = 96 -> 2 tiles


# ----------------------------------------------------------------------------- compile (optional)


def test_tilelang_kernels_lower_and_compile_for_sm90() -> None:
    """Lowering + nvcc for sm_90a, no GPU needed: catches TileLang API misuse on machines where
    tilelang and the CUDA toolkit are installed (CI has neither, so it skips there)."""
    tilelang = pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": "sm_90a"})
    cases = [
        mhc_tilelang.build_mix_kernel(7168, "bfloat16", False, *mhc_tilelang.mix_config(1, 7168)),
        mhc_tilelang.build_mix_kernel(96, "bfloat16", True, *mhc_tilelang.mix_config(1000, 96)),
        mhc_tilelang.build_finalize_kernel(7168, "bfloat16", "float32", True),
        mhc_tilelang.build_finalize_kernel(96, "float32", "float32", False),
    ]
    with target:
        for prim in cases:
            kernel = tilelang.compile(prim, target=target, execution_backend="tvm_ffi")
            assert "__global__" in kernel.get_kernel_source()


if __name__ == "__main__":
    run_this_file(__file__)
