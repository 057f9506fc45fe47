"""mHC kernels (Triton, and TileLang when it imports) on a GPU against the torch reference (bf16
residual, DeepSeek V4 sizes). Every kernel test runs once per backend, chosen through
SGLANG_MHC_BACKEND, and asserts that backend really ran; the TileLang ones skip with the import
error when tilelang is missing. Both backends are held to the same tolerances.

Tolerances: post/comb are fp32 in both paths; the mixes differ only in summation order over K = 4H
<= 28672 terms (Triton's tf32x3 dot, its bf16-MMA kernel on three bf16 pieces of fn from 256 tokens,
and TileLang's fp32 FMAs are all ~fp32 exact per product), so they agree to ~1e-6 (the MMA kernel's
tensor-core accumulation to ~7e-6, bench_mhc_mix.py); 20 Sinkhorn steps keep that small -> atol
1e-4. The layer input and the new residual are fp32 sums rounded once to bf16: values this close can
straddle a rounding boundary, so an element may be 1 bf16 ulp off (rtol 2^-7); with the fused
RMSNorm a 1-ulp input difference plus the output rounding allows 2 ulps (2^-6). Near zero a relative
bound is meaningless: the layer input is a sum of four stream values of magnitude up to ~10 weighted
by the pre mixes, so a ~7e-6 difference there moves a cancelling sum by up to ~5e-5 absolute, the
floor. A systematic error (wrong rounding mode, a missed term) would move most elements, so we also
require that at most 2% of elements differ at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from sglang.kernels.ops.layernorm import mhc as mhc_kernels
from sglang.kernels.ops.layernorm import mhc_mix_mma, mhc_tilelang, mhc_triton
from sglang.kernels.ops.layernorm.mhc_params import MhcParams
from sglang.srt.distributed.symm_mem import output_scope
from sglang.srt.environ import envs
from sglang.srt.layers import mhc
from sglang.test.alloc_recorder import SymmetricScopeRecorder
from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file

register_cuda_ci(est_time=40, suite="h200-1gpu")

HC = 4
E = MhcParams(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
NORM_EPS = 1e-6
BF16_ULP = 2.0**-7


def _tilelang_missing() -> str | None:
    try:
        import tilelang  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError
        return f"tilelang does not import ({type(exc).__name__}: {exc})"
    return None


# Imported only with a GPU: the import takes seconds, and without a GPU every test skips anyway.
_TL_MISSING = _tilelang_missing() if torch.cuda.is_available() else "needs a CUDA GPU"
BACKENDS = [
    pytest.param("triton", id="triton"),
    pytest.param(
        "tilelang",
        id="tilelang",
        marks=pytest.mark.skipif(_TL_MISSING is not None, reason=_TL_MISSING or ""),
    ),
]
# The kernel entry points that write into a caller's ``out`` (for the guard-row check).
_PRE_INTO: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "triton": mhc_triton.mhc_pre_triton,
    "tilelang": mhc_tilelang.mhc_pre_tilelang,
}


# Both DeepSeek V4 widths, from one decode token to a long prefill chunk, with and without the
# fused RMSNorm: the grid of the pre and fused post+pre checks.
NORM_TOKENS_HIDDEN = [
    (with_norm, t, h)
    for with_norm in (False, True)
    for t in (1, 7, 128, 1000, 2500)
    for h in (4096, 7168)
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    with envs.SGLANG_MHC_BACKEND.override(request.param):
        yield request.param


def _assert_backend(residual: torch.Tensor, backend: str) -> None:
    assert mhc.select_backend(residual)[0] == backend


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(
        output_scope, "use_symmetric_memory", lambda group, disabled=False: contextlib.nullcontext()
    )
    monkeypatch.setattr(output_scope, "is_allocation_symmetric", lambda: False)
    monkeypatch.setattr(output_scope, "get_tp_group_or_none", lambda: None)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch reference must be true fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


def _poison_allocator() -> None:
    """Fill the caching allocator's free blocks with NaN, so an output element (or workspace entry)
    the kernels never write shows up as NaN."""
    big = torch.full((256 << 20,), float("nan"), dtype=torch.float32, device="cuda")
    # Allocations under 1 MiB come from the allocator's small-block pool: poison that too.
    small = [torch.full((64 << 10,), float("nan"), device="cuda") for _ in range(128)]
    del big, small


def _inputs(
    t: int, h: int, seed: int
) -> tuple[
    torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = (torch.randn(t, HC, h, generator=gen, device="cuda") * 2).bfloat16()
    x = torch.randn(t, h, generator=gen, device="cuda").bfloat16()
    fn = torch.randn(24, HC * h, generator=gen, device="cuda") * 0.01  # mixes of order 1
    scale = torch.rand(3, generator=gen, device="cuda") * 1.5 + 0.25
    base = torch.randn(24, generator=gen, device="cuda") * 0.5
    norm_w = torch.rand(h, generator=gen, device="cuda") + 0.5
    return r, x, (fn, scale, base), norm_w


def _assert_bf16_close(got: torch.Tensor, ref: torch.Tensor, ulps: int) -> None:
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), ref.float(), atol=5e-5, rtol=ulps * BF16_ULP)
    if got.numel():
        assert float((got != ref).float().mean()) <= 0.02


def _assert_mix_close(
    post: torch.Tensor, comb: torch.Tensor, rpost: torch.Tensor, rcomb: torch.Tensor
) -> None:
    assert post.dtype == comb.dtype == torch.float32
    torch.testing.assert_close(post, rpost, atol=1e-4, rtol=0)
    torch.testing.assert_close(comb, rcomb, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("with_norm", "t", "h"), NORM_TOKENS_HIDDEN)
def test_pre_matches_torch(t: int, h: int, with_norm: bool, backend: str) -> None:
    r, _, p, w = _inputs(t, h, seed=t * 31 + h + with_norm)
    _assert_backend(r, backend)
    params = E.with_norm(w, NORM_EPS) if with_norm else E
    _poison_allocator()
    y, post, comb = mhc.mhc_pre(r, *p, params)
    ry, rpost, rcomb = mhc_kernels._pre_torch(r, *p, params)
    _assert_mix_close(post, comb, rpost, rcomb)
    _assert_bf16_close(y, ry, ulps=2 if with_norm else 1)

    # Writes exactly its T rows: a NaN guard row after them stays NaN.
    buf = torch.full((t + 1, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    _PRE_INTO[backend](r, *p, buf[:t], params)
    assert torch.equal(buf[:t], y) and bool(torch.isnan(buf[t]).all())


@pytest.mark.parametrize(("with_norm", "t", "h"), NORM_TOKENS_HIDDEN)
def test_fused_post_pre_matches_torch(t: int, h: int, with_norm: bool, backend: str) -> None:
    r, x, p, w = _inputs(t, h, seed=t * 17 + h + with_norm)
    _assert_backend(r, backend)
    _, post, comb = mhc_kernels._pre_torch(r, *p, E)
    nxt = (p[0].flip(0).contiguous(), p[1].flip(0).contiguous(), p[2].flip(0).contiguous())
    params = E.with_norm(w, NORM_EPS) if with_norm else E
    _poison_allocator()
    nr, y, post2, comb2 = mhc.mhc_fused_post_pre(x, r, post, comb, *nxt, params)
    _assert_bf16_close(nr, mhc.hc_post_torch_impl(x, r, post, comb), ulps=1)
    # The next pre reads the stored new residual: compare with torch on that same residual.
    ry, rpost, rcomb = mhc_kernels._pre_torch(nr, *nxt, params)
    _assert_mix_close(post2, comb2, rpost, rcomb)
    _assert_bf16_close(y, ry, ulps=2 if with_norm else 1)

    # Fused == unfused (the Triton post kernel, then this backend's pre kernel).
    _poison_allocator()
    nr_u = mhc.mhc_post(x, r, post, comb)
    assert not torch.isnan(nr_u).any()
    torch.testing.assert_close(nr_u.float(), nr.float(), atol=0, rtol=BF16_ULP)
    y_u, post_u, comb_u = mhc.mhc_pre(nr, *nxt, params)
    torch.testing.assert_close(post_u, post2, atol=1e-5, rtol=0)
    torch.testing.assert_close(comb_u, comb2, atol=1e-5, rtol=0)
    _assert_bf16_close(y_u, y, ulps=1)


@pytest.mark.parametrize("h", [4096, 7168])
def test_mix_paths_switch_at_threshold_and_agree(h: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton only: from MMA_MIN_T tokens the mixes run on the bf16-MMA kernel, below it on the
    split kernel; forced onto either path at the threshold, both match the torch reference."""
    calls: list[int] = []
    real = mhc_mix_mma.mix_partials_mma

    def spy(residual: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(residual.shape[0])
        return real(residual, *args, **kwargs)

    monkeypatch.setattr(mhc_mix_mma, "mix_partials_mma", spy)
    n = mhc_triton.MMA_MIN_T
    with envs.SGLANG_MHC_BACKEND.override("triton"):
        mhc.reset_backend_selection()
        for t in (n - 1, n):
            r, _, p, w = _inputs(t, h, seed=t + h)
            mhc.mhc_pre(r, *p, E.with_norm(w, NORM_EPS))
        assert calls == [n]
        r, _, p, w = _inputs(n, h, seed=5)
        ry, rpost, rcomb = mhc_kernels._pre_torch(r, *p, E.with_norm(w, NORM_EPS))
        # The MMA kernel's partial mixes against the float64 product: ~fp32 exact.
        fn = p[0].float().contiguous()
        part, _ = mhc_mix_mma.mix_partials_mma(r, None, None, None, None, fn)
        exact = r.double().reshape(n, -1) @ fn.double().T
        err = (part.sum(0)[:, :24].double() - exact).abs().max() / exact.abs().max()
        assert float(err) < 1e-5, float(err)
        for min_t in (n, 1 << 40):  # the MMA kernel, then the split one
            monkeypatch.setattr(mhc_triton, "MMA_MIN_T", min_t)
            _poison_allocator()
            y, post, comb = mhc.mhc_pre(r, *p, E.with_norm(w, NORM_EPS))
            _assert_mix_close(post, comb, rpost, rcomb)
            _assert_bf16_close(y, ry, ulps=2)
    mhc.reset_backend_selection()


def test_empty_batch_and_head(backend: str) -> None:
    r, x, p, w = _inputs(0, 4096, seed=1)
    _assert_backend(r, backend)
    y, post, comb = mhc.mhc_pre(r, *p, E.with_norm(w, NORM_EPS))
    assert y.shape == (0, 4096) and post.shape == (0, HC) and comb.shape == (0, HC, HC)
    outs = mhc.mhc_fused_post_pre(x, r, post, comb, *p, E)
    assert [tuple(o.shape) for o in outs] == [(0, HC, 4096), (0, 4096), (0, HC), (0, HC, HC)]
    assert mhc.mhc_post(x, r, post, comb).shape == (0, HC, 4096)
    r, _, _, _ = _inputs(5, 4096, seed=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    hp = (
        torch.randn(HC, HC * 4096, generator=gen, device="cuda") * 0.01,
        torch.rand(1, device="cuda"),
        torch.randn(HC, device="cuda"),
    )
    head = mhc.mhc_head(r, *hp, E)
    assert head.shape == (5, 4096) and head.dtype == torch.bfloat16 and not torch.isnan(head).any()


def test_kernel_path_puts_only_layer_input_in_symmetric_scope(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    r, x, p, w = _inputs(7, 4096, seed=4)
    _assert_backend(r, backend)
    group = object()
    monkeypatch.setattr(output_scope, "is_allocation_symmetric", lambda: True)
    monkeypatch.setattr(output_scope, "get_tp_group_or_none", lambda: group)
    _, post, comb = mhc_kernels._pre_torch(r, *p, E)  # before recording
    for fused in (False, True):
        rec = SymmetricScopeRecorder()
        monkeypatch.setattr(output_scope, "use_symmetric_memory", rec)
        if fused:
            nr, y, post2, comb2 = mhc.mhc_fused_post_pre(
                x, r, post, comb, *p, E.with_norm(w, NORM_EPS)
            )
            others = [nr, post2, comb2]
        else:
            y, post2, comb2 = mhc.mhc_pre(r, *p, E.with_norm(w, NORM_EPS))
            others = [post2, comb2]
        assert rec.entered == [(group, False)]
        assert rec.allocated == [y.untyped_storage().data_ptr()]
        assert not {o.untyped_storage().data_ptr() for o in others} & set(rec.allocated)


def test_fused_post_pre_replays_in_cuda_graph(backend: str) -> None:
    t, h = 7, 7168
    r, x, p, w = _inputs(t, h, seed=5)
    _assert_backend(r, backend)
    _, post, comb = mhc_kernels._pre_torch(r, *p, E)
    params = E.with_norm(w, NORM_EPS)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up on the capture stream
            mhc.mhc_fused_post_pre(x, r, post, comb, *p, params)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = mhc.mhc_fused_post_pre(x, r, post, comb, *p, params)
    r2, x2, _, _ = _inputs(t, h, seed=6)
    r.copy_(r2)
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    expected = mhc.mhc_fused_post_pre(x, r, post, comb, *p, params)
    for a, b in zip(outs, expected):
        assert torch.equal(a, b)


if __name__ == "__main__":
    run_this_file(__file__)
