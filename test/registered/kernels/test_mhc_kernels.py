"""mHC (DeepSeek V4 hyper-connections) on CPU: the torch path against an fp64 re-derivation and
against transformers' own modules, Sinkhorn, T = 0, which outputs go to the symmetric pool, and
the Triton kernels under the interpreter (in a subprocess), where the fusion identities (fused
post+pre == post then pre, fused norm == separate RMSNorm) are checked kernel against kernel: on
the torch path the fused functions are the separate ones called in sequence, so comparing them
there could not fail. test_mhc_kernels_gpu.py checks fused == unfused for every GPU backend."""

from __future__ import annotations

import contextlib
import textwrap
from typing import Any

import pytest
import torch
from torch import nn

from sglang.kernels.ops.layernorm import mhc as mhc_kernels
from sglang.kernels.ops.layernorm.mhc_params import MhcParams
from sglang.srt.distributed.symm_mem import output_scope
from sglang.srt.layers import mhc
from sglang.test.alloc_recorder import SymmetricScopeRecorder
from sglang.test.ci_register import register_cpu_ci
from sglang.test.hang_guard import hang_guard
from sglang.test.interpreter import run_under_interpreter
from sglang.test.run import run_this_file

register_cpu_ci(est_time=40)

HC = 4
NMIX = (2 + HC) * HC
RMS_EPS, HC_EPS, NORM_EPS, ITERS = 1e-5, 1e-4, 1e-6, 20  # distinct values, so a swapped eps shows
P = MhcParams(RMS_EPS, HC_EPS, ITERS)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # Single process: no TP group, the pool off.
    monkeypatch.setattr(
        output_scope, "use_symmetric_memory", lambda group, disabled=False: contextlib.nullcontext()
    )
    monkeypatch.setattr(output_scope, "is_allocation_symmetric", lambda: False)
    monkeypatch.setattr(output_scope, "get_tp_group_or_none", lambda: None)


def _params(
    h: int, gen: torch.Generator, n: int = NMIX
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random fn / scale / base (scale far from 1, base far from 0: transformers inits them so)."""
    fn = torch.randn(n, HC * h, generator=gen) * 0.05
    scale = torch.rand(3 if n == NMIX else 1, generator=gen) * 1.5 + 0.25
    base = torch.randn(n, generator=gen) * 0.5
    return fn, scale, base


def _residual(t: int, h: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(t, HC, h, generator=gen) * 2.0).to(dtype)


# ----------------------------------------------------------------------------- fp64 re-derivation


def _ref64_pre(
    r: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The design-doc maths, token by token, in float64 -> (y unrounded, post, comb)."""
    t, hc, h = r.shape
    x = r.double()
    ys, posts, combs = [], [], []
    for i in range(t):
        flat = x[i].reshape(-1)
        rs = 1.0 / torch.sqrt((flat * flat).sum() / flat.numel() + RMS_EPS)
        m = torch.mv(fn.double(), flat) * rs
        s, b = scale.double(), base.double()
        pre = 1.0 / (1.0 + torch.exp(-(m[:hc] * s[0] + b[:hc]))) + HC_EPS
        post = 2.0 / (1.0 + torch.exp(-(m[hc : 2 * hc] * s[1] + b[hc : 2 * hc])))
        logits = (m[2 * hc :] * s[2] + b[2 * hc :]).reshape(hc, hc)
        e = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
        c = e / e.sum(dim=1, keepdim=True) + HC_EPS
        c = c / (c.sum(dim=0, keepdim=True) + HC_EPS)
        for _ in range(ITERS - 1):
            c = c / (c.sum(dim=1, keepdim=True) + HC_EPS)
            c = c / (c.sum(dim=0, keepdim=True) + HC_EPS)
        ys.append(sum(pre[k] * x[i, k] for k in range(hc)))
        posts.append(post)
        combs.append(c)
    if t == 0:
        return x.new_zeros(0, h), x.new_zeros(0, hc), x.new_zeros(0, hc, hc)
    return torch.stack(ys), torch.stack(posts), torch.stack(combs)


def _ref64_post(
    x: torch.Tensor, r: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    # new[j] = post[j] * x + sum_k comb[k, j] * r[k]
    return post.double()[:, :, None] * x.double()[:, None, :] + torch.einsum(
        "tkj,tkd->tjd", comb.double(), r.double()
    )


def _assert_rounded_close(got: torch.Tensor, exact: torch.Tensor, ulps: float = 1.0) -> None:
    """``got`` (bf16/fp32) within ``ulps`` units of its dtype's rounding of the fp64 ``exact``."""
    rel = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-22}[got.dtype]
    err = (got.double() - exact).abs()
    bound = ulps * rel * exact.abs() + 1e-30 + (1e-6 if got.dtype == torch.float32 else 0.0)
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 6])
def test_pre_post_head_match_fp64_derivation(dtype: torch.dtype, t: int) -> None:
    gen = torch.Generator().manual_seed(t + (dtype == torch.bfloat16))
    h = 96
    r = _residual(t, h, dtype, gen)
    fn, scale, base = _params(h, gen)
    y, post, comb = mhc.mhc_pre_torch(r, fn, scale, base, P)
    y64, post64, comb64 = _ref64_pre(r, fn, scale, base)
    assert y.dtype == dtype and post.dtype == comb.dtype == torch.float32
    assert y.shape == (t, h) and post.shape == (t, HC) and comb.shape == (t, HC, HC)
    torch.testing.assert_close(post.double(), post64, atol=2e-6, rtol=0)
    torch.testing.assert_close(comb.double(), comb64, atol=2e-6, rtol=0)
    _assert_rounded_close(y, y64)  # fp32 maths, one rounding to dtype

    x = (torch.randn(t, h, generator=gen) * 3).to(dtype)
    new = mhc.hc_post_torch_impl(x, r, post, comb)
    assert new.dtype == dtype and new.shape == (t, HC, h)
    _assert_rounded_close(new, _ref64_post(x, r, post, comb))

    hfn, hscale, hbase = _params(h, gen, n=HC)
    head = mhc.mhc_head(r, hfn, hscale, hbase, P)
    flat = r.double().reshape(t, -1)
    rs = torch.rsqrt(flat.square().mean(-1, keepdim=True) + RMS_EPS)
    w = torch.sigmoid(flat @ hfn.double().T * rs * hscale.double() + hbase.double()) + HC_EPS
    _assert_rounded_close(head, (w[:, :, None] * r.double()).sum(1))


# ----------------------------------------------------------------------------- transformers


def _tf_config(h: int) -> Any:
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config(
        hidden_size=h,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=32,
        q_lora_rank=32,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        vocab_size=64,
        rms_norm_eps=RMS_EPS,
        hc_eps=HC_EPS,
        hc_sinkhorn_iters=ITERS,
    )


def _set_hc(module: nn.Module, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> None:
    module.fn.data.copy_(fn)
    module.scale.data.copy_(scale)
    module.base.data.copy_(base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_hyper_connection_and_head(dtype: torch.dtype) -> None:
    tfm = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    gen = torch.Generator().manual_seed(3)
    h, t = 64, 9
    cfg = _tf_config(h)
    r = _residual(t, h, dtype, gen)
    fn, scale, base = _params(h, gen)
    hc_mod = tfm.DeepseekV4HyperConnection(cfg)
    _set_hc(hc_mod, fn, scale, base)
    with torch.no_grad():
        tf_post, tf_comb, tf_y = hc_mod(r.unsqueeze(0))
    y, post, comb = mhc.mhc_pre(r, fn, scale, base, P)
    # Same fp32 maths; transformers normalises before the GEMV, we after (a few fp32 ulps).
    torch.testing.assert_close(post, tf_post[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(comb, tf_comb[0], atol=1e-5, rtol=0)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.float(), tf_y[0].float(), atol=1e-5, rtol=ulp)

    head_mod = tfm.DeepseekV4HyperHead(cfg)
    hfn, hscale, hbase = _params(h, gen, n=HC)
    head_mod.hc_fn.data.copy_(hfn)
    head_mod.hc_scale.data.copy_(hscale)
    head_mod.hc_base.data.copy_(hbase)
    with torch.no_grad():
        tf_head = head_mod(r.unsqueeze(0))[0]
    head = mhc.mhc_head(r, hfn, hscale, hbase, P)
    torch.testing.assert_close(head.float(), tf_head.float(), atol=1e-5, rtol=ulp)


class _StubAttn(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = w

    def forward(self, x: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return torch.tanh(x @ self.w), None


class _StubMlp(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = w

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sin(x @ self.w)


def test_decoder_layer_flow_matches_transformers() -> None:
    """pre(+norm) -> attn -> fused post+pre(+norm) -> mlp -> post == transformers' decoder layer
    (fp32, attention and MoE replaced by fixed stubs, every hc parameter and norm weight random).
    This pins the comb transpose in post and the norm fused into pre."""
    tfm = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    gen = torch.Generator().manual_seed(5)
    h, t = 64, 7
    layer = tfm.DeepseekV4DecoderLayer(_tf_config(h), 0)
    wa, wm = torch.randn(h, h, generator=gen) / 8, torch.randn(h, h, generator=gen) / 8
    layer.self_attn, layer.mlp = _StubAttn(wa), _StubMlp(wm)
    attn_p, ffn_p = _params(h, gen), _params(h, gen)
    _set_hc(layer.attn_hc, *attn_p)
    _set_hc(layer.ffn_hc, *ffn_p)
    ln1, ln2 = torch.rand(h, generator=gen) + 0.5, torch.rand(h, generator=gen) + 0.5
    layer.input_layernorm.weight.data.copy_(ln1)
    layer.post_attention_layernorm.weight.data.copy_(ln2)
    r = _residual(t, h, torch.float32, gen)
    with torch.no_grad():
        expected = layer(r.unsqueeze(0))[0]

    y, post, comb = mhc.mhc_pre(r, *attn_p, P.with_norm(ln1, RMS_EPS))
    a = layer.self_attn(y)[0]
    r2, y2, post2, comb2 = mhc.mhc_fused_post_pre(
        a, r, post, comb, *ffn_p, P.with_norm(ln2, RMS_EPS)
    )
    out = mhc.mhc_post(layer.mlp(y2), r2, post2, comb2)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------- identities


# Fused post+pre == post then pre, and the fused norm == a separate RMSNorm, are checked on the
# Triton kernels in _INTERP_SCRIPT below (and on the GPU backends in test_mhc_kernels_gpu.py): the
# torch path's fused functions just call the separate ones, so a CPU comparison could not fail.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_matches_transformers_rmsnorm(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    t, h = 6, 128
    r = _residual(t, h, dtype, gen)
    p = _params(h, gen)
    w = torch.rand(h, generator=gen) + 0.5
    with pytest.raises(ValueError, match="norm_eps"):
        MhcParams(RMS_EPS, HC_EPS, ITERS, norm_weight=w)
    y, _, _ = mhc.mhc_pre(r, *p, P)
    yn, _, _ = mhc.mhc_pre(r, *p, P.with_norm(w, NORM_EPS))
    tfm = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    norm = tfm.DeepseekV4RMSNorm(h, eps=NORM_EPS)
    norm.weight.data.copy_(w)
    with torch.no_grad():
        assert torch.equal(yn, norm(y))


def test_pre_entry_points_share_mhc_pre_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_mhc_pre_impl`` (upstream's name for the pre kernel) is the one body behind mhc_pre and
    behind the pre half of mhc_fused_post_pre; its output matches the fp64 derivation."""
    gen = torch.Generator().manual_seed(15)
    t, h = 5, 64
    r = _residual(t, h, torch.float32, gen)
    p = _params(h, gen)
    x = torch.randn(t, h, generator=gen)
    w = torch.rand(h, generator=gen) + 0.5
    calls: list[torch.Tensor] = []
    real = mhc_kernels._mhc_pre_impl

    def spy(residual: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(residual)
        return real(residual, *args, **kwargs)

    monkeypatch.setattr(mhc_kernels, "_mhc_pre_impl", spy)
    y, post, comb = mhc.mhc_pre(r, *p, P)
    assert len(calls) == 1 and calls[0] is r
    y64, post64, comb64 = _ref64_pre(r, *p)
    torch.testing.assert_close(post.double(), post64, atol=2e-6, rtol=0)
    torch.testing.assert_close(comb.double(), comb64, atol=2e-6, rtol=0)
    _assert_rounded_close(y, y64)
    new_r, y2, _, _ = mhc.mhc_fused_post_pre(x, r, post, comb, *p, P.with_norm(w, NORM_EPS))
    assert len(calls) == 2 and torch.equal(calls[1], new_r)
    direct, _, _ = real(new_r, *p, P.with_norm(w, NORM_EPS))
    assert torch.equal(y2, direct)


def test_sinkhorn_comb_is_doubly_stochastic() -> None:
    gen = torch.Generator().manual_seed(13)
    t, h = 64, 64
    r = _residual(t, h, torch.float32, gen)
    fn, scale, base = _params(h, gen)
    _, _, comb = mhc.mhc_pre(r, fn, scale, base, MhcParams(RMS_EPS, 1e-6, ITERS))
    assert bool((comb > 0).all())
    # The last step normalises columns (exact up to eps); rows are converged to ~1e-3.
    torch.testing.assert_close(comb.sum(-2), torch.ones(t, HC), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(t, HC), atol=1e-3, rtol=0)


def test_empty_batch() -> None:
    gen = torch.Generator().manual_seed(14)
    h = 32
    r = _residual(0, h, torch.bfloat16, gen)
    p = _params(h, gen)
    y, post, comb = mhc.mhc_pre(r, *p, P.with_norm(torch.ones(h), NORM_EPS))
    assert y.shape == (0, h) and post.shape == (0, HC) and comb.shape == (0, HC, HC)
    x = torch.zeros(0, h, dtype=torch.bfloat16)
    assert mhc.mhc_post(x, r, post, comb).shape == (0, HC, h)
    outs = mhc.mhc_fused_post_pre(x, r, post, comb, *p, P)
    assert [tuple(o.shape) for o in outs] == [(0, HC, h), (0, h), (0, HC), (0, HC, HC)]
    assert mhc.mhc_head(r, *_params(h, gen, n=HC), P).shape == (0, h)


# ----------------------------------------------------------------------------- symmetric pool


_SENTINEL_GROUP = object()


def _record(monkeypatch: pytest.MonkeyPatch, symmetric: bool) -> SymmetricScopeRecorder:
    rec = SymmetricScopeRecorder()
    monkeypatch.setattr(output_scope, "use_symmetric_memory", rec)
    monkeypatch.setattr(output_scope, "is_allocation_symmetric", lambda: symmetric)
    monkeypatch.setattr(output_scope, "get_tp_group_or_none", lambda: _SENTINEL_GROUP)
    return rec


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("with_norm", [False, True])
def test_only_layer_input_is_symmetric(monkeypatch: pytest.MonkeyPatch, with_norm: bool) -> None:
    gen = torch.Generator().manual_seed(15)
    t, h = 4, 64
    r = _residual(t, h, torch.bfloat16, gen)
    p = _params(h, gen)
    nw = torch.rand(h, generator=gen) if with_norm else None
    params = P if nw is None else P.with_norm(nw, NORM_EPS)

    rec = _record(monkeypatch, symmetric=True)
    y, post, comb = mhc.mhc_pre(r, *p, params)
    assert rec.allocated == [_ptr(y)] and rec.entered == [(_SENTINEL_GROUP, False)]

    rec = _record(monkeypatch, symmetric=True)
    y0, _, _ = mhc.mhc_pre_torch(r, *p, P)
    assert rec.allocated == [_ptr(y0)] and rec.entered == [(_SENTINEL_GROUP, False)]

    rec = _record(monkeypatch, symmetric=True)
    x = torch.randn(t, h, generator=gen).bfloat16()
    r2, y2, post2, comb2 = mhc.mhc_fused_post_pre(x, r, post, comb, *p, params)
    assert rec.allocated == [_ptr(y2)] and rec.entered == [(_SENTINEL_GROUP, False)]
    assert not {_ptr(r2), _ptr(post2), _ptr(comb2)} & set(rec.allocated)

    rec = _record(monkeypatch, symmetric=True)
    mhc.mhc_post(x, r, post, comb)
    mhc.mhc_head(r, *_params(h, gen, n=HC), P)
    assert rec.entered == [] and rec.allocated == []

    rec = _record(monkeypatch, symmetric=False)  # ranks may allocate differently: scope disabled
    mhc.mhc_pre(r, *p, params)
    mhc.mhc_fused_post_pre(x, r, post, comb, *p, params)
    assert rec.entered == [(_SENTINEL_GROUP, True)] * 2 and rec.allocated == []


# ----------------------------------------------------------------------------- Triton (interpreter)

_INTERP_SCRIPT = textwrap.dedent("""
    import contextlib
    import torch
    from sglang.kernels.ops.layernorm import mhc as mhc_kernels
    from sglang.kernels.ops.layernorm import mhc_triton
    from sglang.kernels.ops.layernorm.mhc_params import MhcParams
    from sglang.srt.distributed.symm_mem import output_scope
    from sglang.srt.layers import mhc
    from sglang.srt.layers.layernorm import rms_norm
    from sglang.test.alloc_recorder import SymmetricScopeRecorder

    output_scope.is_allocation_symmetric = lambda: True
    output_scope.get_tp_group_or_none = lambda: None
    mhc._backend = lambda residual: "triton"  # CPU tensors through the Triton path
    E = MhcParams(1e-5, 1e-4, 20)

    def close(a, b, atol, rtol=0.0):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)

    gen = torch.Generator().manual_seed(0)
    # (T, H): one split; several splits; >32 splits (two split tiles in the finalize); T = 0.
    cases = [(3, 64, torch.float32), (17, 128, torch.bfloat16), (1, 2560, torch.bfloat16),
             (2, 96, torch.bfloat16), (0, 64, torch.bfloat16)]
    # Each case with the finalize's row in registers (one pass), then looping over 1024-wide
    # blocks (the path of larger batches and of rows wider than _ONE_PASS_MAX_H); then with the
    # mixes on the bf16-MMA kernel (mhc_mix_mma) wherever it takes the case (bf16, H a multiple
    # of its step; the rest fall back to the split kernel).
    never = 1 << 40
    settings = ((mhc_triton._ONE_PASS_MAX_H, never), (0, never), (0, 0))
    for (one_pass_max_h, mma_min_t), (t, h, dtype) in [(m, c) for m in settings for c in cases]:
        mhc_triton._ONE_PASS_MAX_H = one_pass_max_h
        mhc_triton.MMA_MIN_T = mma_min_t
        assert t <= mhc_triton._ONE_PASS_MAX_T
        r = (torch.randn(t, 4, h, generator=gen) * 2).to(dtype)
        fn = torch.randn(24, 4 * h, generator=gen) * 0.05
        sc, b = torch.rand(3, generator=gen) + 0.25, torch.randn(24, generator=gen) * 0.5
        x = torch.randn(t, h, generator=gen).to(dtype)
        # The interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even), so a
        # bf16 value may be 1 ulp off, and 2 after the fused norm (rounded sum, rounded output).
        ulp = 2.0 ** -6 if dtype == torch.bfloat16 else 1e-5
        y0 = post0 = comb0 = None  # the un-normed pre, for the norm-fusion check
        for nw in (None, torch.rand(h, generator=gen) + 0.5):
            params = E if nw is None else E.with_norm(nw, 1e-6)
            rec = SymmetricScopeRecorder()
            output_scope.use_symmetric_memory = rec
            y, post, comb = mhc.mhc_pre(r, fn, sc, b, params)
            if t:
                assert rec.allocated == [y.untyped_storage().data_ptr()], rec.allocated
            ry, rpost, rcomb = mhc_kernels._pre_torch(r, fn, sc, b, params)
            close(post, rpost, 2e-6)
            close(comb, rcomb, 2e-6)
            close(y, ry, 1e-5, ulp)
            if nw is None:
                y0, post0, comb0 = y, post, comb
            else:
                # Fused norm == the separate RMSNorm of the un-normed kernel's (rounded) output;
                # the norm leaves post and comb bit for bit as they were.
                assert torch.equal(post, post0) and torch.equal(comb, comb0)
                close(y, rms_norm(y0, nw, 1e-6), 1e-5, ulp)

            r2 = mhc.mhc_post(x, r, post, comb)
            close(r2, mhc.hc_post_torch_impl(x, r, post, comb), 1e-5, ulp)

            rec = SymmetricScopeRecorder()
            output_scope.use_symmetric_memory = rec
            fr, fy, fpost, fcomb = mhc.mhc_fused_post_pre(x, r, post, comb, fn, sc, b, params)
            if t:
                assert rec.allocated == [fy.untyped_storage().data_ptr()], rec.allocated
            assert torch.equal(fr, r2)  # same post code in both kernels
            # The next pre reads the (rounded) new residual: compare with torch on that residual.
            ry, rpost, rcomb = mhc_kernels._pre_torch(fr, fn, sc, b, params)
            close(fpost, rpost, 2e-6)
            close(fcomb, rcomb, 2e-6)
            close(fy, ry, 1e-5, ulp)
            # Fused post+pre kernel == the post kernel, then the pre kernel on its output: the
            # same code and order of operations, so bit for bit (the MMA kernel too: one tile).
            unfused = (r2, *mhc.mhc_pre(r2, fn, sc, b, params))
            for got, want in zip((fr, fy, fpost, fcomb), unfused):
                assert torch.equal(got, want)
    print("MHC_INTERP_OK")
    """)


def test_triton_kernels_under_interpreter() -> None:
    # 73 s alone on a 2-core machine (the interpreter runs every kernel at several shapes)
    run_under_interpreter(marker="MHC_INTERP_OK", code=_INTERP_SCRIPT, timeout=hang_guard(80))


if __name__ == "__main__":
    run_this_file(__file__)
