"""``hc_pre_torch_impl`` (srt/models/deepseek_v4.py, upstream's name for the model's torch mHC pre):
it equals transformers' own hyper-connection + RMSNorm on random parameters, the CPU forward runs
every sublayer's pre through it, and on CUDA the fused kernels (mhc_pre with the norm fused,
mhc_fused_post_pre) agree with it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as tfm

from sglang.srt.layers import mhc
from sglang.srt.layers.mhc import MhcParams
from sglang.srt.models import deepseek_v4
from sglang.test.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.dsv4_tiny import CONFIG_B, our_model, reference_model, token_ids
from sglang.test.run import run_this_file

register_cpu_ci(est_time=8)
register_cuda_ci(est_time=15, suite="h200-1gpu")  # its @pytest.mark.gpu tests

MIX = MhcParams(rms_eps=1e-5, hc_eps=1e-4, sinkhorn_iters=7)
NORM_EPS = 1e-6


def _random_pre(h: int, hc: int, t: int, device: str) -> tuple[torch.Tensor, Any]:
    """A residual and one sublayer's ``(fn, scale, base, params)`` (the norm weight in params)."""
    g = torch.Generator().manual_seed(h + hc + t)
    n = (2 + hc) * hc
    residual = torch.randn(t, hc, h, generator=g) * 2
    fn, scale, base, norm_w = (
        p.to(device)
        for p in (
            torch.randn(n, hc * h, generator=g) * 0.05,
            torch.rand(3, generator=g) * 1.5 + 0.25,
            torch.randn(n, generator=g) * 0.5,
            torch.rand(h, generator=g) + 0.5,
        )
    )
    return residual.to(device), (fn, scale, base, MIX.with_norm(norm_w, NORM_EPS))


@pytest.mark.parametrize("hc", [1, 2, 4])
def test_hc_pre_torch_impl_matches_transformers(hc: int) -> None:
    h, t = 48, 7
    residual, hc_params = _random_pre(h, hc, t, "cpu")
    fn, scale, base, params = hc_params
    cfg = tfm.DeepseekV4Config(
        hidden_size=h,
        hc_mult=hc,
        hc_sinkhorn_iters=MIX.sinkhorn_iters,
        hc_eps=MIX.hc_eps,
        rms_norm_eps=MIX.rms_eps,
        num_hidden_layers=1,
    )
    hyper = tfm.DeepseekV4HyperConnection(cfg)
    norm = tfm.DeepseekV4RMSNorm(h, eps=NORM_EPS)
    with torch.no_grad():
        hyper.fn.copy_(fn)
        hyper.scale.copy_(scale)
        hyper.base.copy_(base)
        norm.weight.copy_(params.norm_weight)
        post_ref, comb_ref, collapsed = hyper(residual.unsqueeze(0))
        x_ref = norm(collapsed)[0]
    x, post, comb = deepseek_v4.hc_pre_torch_impl(residual, hc_params)
    torch.testing.assert_close(x, x_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(post, post_ref[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(comb, comb_ref[0], atol=1e-6, rtol=1e-6)


def test_cpu_forward_runs_every_pre_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = reference_model(CONFIG_B, seed=4)
    ours = our_model(hf)
    calls: list[int] = []
    real = deepseek_v4.hc_pre_torch_impl

    def spy(residual: torch.Tensor, hc: Any) -> Any:
        calls.append(residual.shape[0])
        return real(residual, hc)

    monkeypatch.setattr(deepseek_v4, "hc_pre_torch_impl", spy)
    n = 40
    ids = token_ids(n, CONFIG_B["vocab_size"], seed=4)
    logits = ours(ids, torch.arange(n))
    assert calls == [n] * (2 * CONFIG_B["num_hidden_layers"])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert float((logits - ref).abs().max() / ref.abs().max()) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 5, 64])
def test_cuda_kernels_match_hc_pre_torch_impl(t: int) -> None:
    h, hc = 128, 4
    residual, hc_params = _random_pre(h, hc, t, "cuda")
    want = deepseek_v4.hc_pre_torch_impl(residual, hc_params)
    got = mhc.mhc_pre(residual, *hc_params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    x = torch.randn(t, h, device="cuda")
    post, comb = want[1], want[2]
    new_r, y, post2, comb2 = mhc.mhc_fused_post_pre(x, residual, post, comb, *hc_params)
    ref_r = mhc.hc_post_torch_impl(x, residual, post, comb)
    torch.testing.assert_close(new_r, ref_r, atol=1e-5, rtol=1e-5)
    for a, b in zip((y, post2, comb2), deepseek_v4.hc_pre_torch_impl(ref_r, hc_params)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


if __name__ == "__main__":
    run_this_file(__file__)
