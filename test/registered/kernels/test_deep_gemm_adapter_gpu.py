"""The real DeepGEMM (sgl-deep-gemm 0.1.5.post1 on the H200's torch 2.11) against the adapter and
against the fake the CPU tests use, so the fake cannot drift from the library:

- the adapter finds it usable and its self-check GEMM passes;
- every entry point the engine resolves exists, and every function of the fake exists in the real
  module with the same parameter names, in order, and the same defaults;
- the fake's SM90 weight transform, pre-dispatch staging and MegaMoE kernel agree with the real
  ones on fresh random inputs;
- a wheel built for another torch (0.1.5.post2, carried by ``scripts/device_check.sh`` into
  ``$SGLANG_TEST_WRONG_DEEP_GEMM_SITE``) gives the one clear line, by the release check and by the
  self-check alone.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

from sglang.srt.layers import deep_gemm_adapter as adapter
from sglang.test.ci_register import register_cuda_ci
from sglang.test.fake_deep_gemm import FakeDeepGemmGemms, FakeMegaBuffer
from sglang.test.fake_mega_moe_kernel import reference_sm90_mega_moe
from sglang.test.run import run_this_file

register_cuda_ci(est_time=60, suite="h200-1gpu")

_FAKE_ONLY = {"calls", "set_calls", "num_sms", "arch"}


@pytest.fixture(scope="module")
def dg():  # type: ignore[no-untyped-def]
    status = adapter.deep_gemm_status()
    if not status.usable:
        pytest.skip(f"DeepGEMM unusable here: {status.reason}")
    return status.module


def test_adapter_finds_it_usable_and_the_self_check_passes(dg) -> None:  # type: ignore[no-untyped-def]
    status = adapter.deep_gemm_status()
    assert status.usable and status.version == dg.__version__
    assert adapter.torch_mismatch(status.version, torch.__version__) is None
    assert adapter.self_check(dg) is None


@pytest.mark.parametrize("capability", sorted(adapter.ENTRY_POINTS))
def test_every_entry_point_resolves(dg, capability: str) -> None:  # type: ignore[no-untyped-def]
    assert callable(adapter.resolve_entry_point(dg, capability))


def _public(cls: type) -> list[str]:
    return [
        n
        for n in dir(cls)
        if not n.startswith("_") and n not in _FAKE_ONLY and callable(getattr(cls, n))
    ]


def test_fake_has_the_real_names_and_signatures(dg) -> None:  # type: ignore[no-untyped-def]
    fake = FakeDeepGemmGemms()
    names = _public(FakeDeepGemmGemms)
    assert len(names) >= 14
    for name in names:
        real = getattr(dg, name, None)
        assert callable(real), f"the fake has {name}(), the real DeepGEMM {dg.__version__} does not"
        try:
            want = inspect.signature(real)
        except (TypeError, ValueError):
            continue  # a compiled tvm-ffi function: its name is all there is to check
        if any(p.kind is p.VAR_POSITIONAL for p in want.parameters.values()):
            continue  # (*args, **kwargs): compiled too
        got = inspect.signature(getattr(fake, name))
        real_params = [(p.name, p.default) for p in want.parameters.values()]
        fake_params = [(p.name, p.default) for p in got.parameters.values()]
        assert fake_params == real_params, f"{name}: fake {got} != real {want}"


def test_fake_sm90_weight_transform_is_the_real_one(dg) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator(device="cuda").manual_seed(1)
    e, inter, hidden = 3, 256, 384
    w13 = torch.randn(e, 2 * inter, hidden, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    w2 = torch.randn(e, hidden, inter, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    s13 = torch.rand(e, 2 * inter // 128, hidden // 128, device="cuda", generator=gen)
    s2 = torch.rand(e, hidden // 128, inter // 128, device="cuda", generator=gen)
    real = dg.transform_weights_for_mega_moe_sm90((w13, s13), (w2, s2))
    fake = FakeDeepGemmGemms(arch=90).transform_weights_for_mega_moe_sm90((w13, s13), (w2, s2))
    for (rq, rs), (fq, fs) in zip(real, fake):
        assert torch.equal(rq.view(torch.uint8), fq.view(torch.uint8)) and torch.equal(rs, fs)


def _staged(dg, t: int, hidden: int, topk: int, num_experts: int, seed: int):  # type: ignore[no-untyped-def]
    """The real buffer after the real pre-dispatch, and the fake's staging of the same batch."""
    from sglang.srt.layers.moe.mega_moe import _get_mega_moe_symm_buffer

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(t, hidden, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    ids = torch.stack(
        [torch.randperm(num_experts, device="cuda", generator=gen)[:topk] for _ in range(t)]
    ).int()
    w = torch.rand(t, topk, device="cuda", generator=gen)
    buf = _get_mega_moe_symm_buffer(
        dg,
        None,
        num_experts=num_experts,
        num_max_tokens_per_rank=64,
        num_topk=topk,
        hidden=hidden,
        intermediate_hidden=256,
    )
    dg.mega_moe_pre_dispatch_sm90(
        x, ids, w, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, num_tokens=t
    )
    cap = buf.x.shape[0]
    fake_buf = FakeMegaBuffer(
        x=torch.empty(cap, hidden, dtype=torch.float8_e4m3fn),
        x_sf=torch.empty(cap, hidden // 128),
        topk_idx=torch.empty(cap, topk, dtype=torch.int64),
        topk_weights=torch.empty(cap, topk),
    )
    FakeDeepGemmGemms(arch=90).mega_moe_pre_dispatch_sm90(
        x.cpu(),
        ids.cpu(),
        w.cpu(),
        fake_buf.x,
        fake_buf.x_sf,
        fake_buf.topk_idx,
        fake_buf.topk_weights,
        num_tokens=t,
    )
    return x, ids, w, buf, fake_buf


def test_fake_sm90_pre_dispatch_stages_what_the_real_one_does(dg) -> None:  # type: ignore[no-untyped-def]
    t, hidden, topk = 13, 512, 3
    _, _, _, buf, fake = _staged(dg, t, hidden, topk, 8, seed=2)
    torch.testing.assert_close(buf.x_sf[:t].cpu(), fake.x_sf[:t], rtol=1e-6, atol=0)
    real_x = buf.x[:t].float().cpu() * buf.x_sf[:t].cpu().repeat_interleave(128, -1)
    fake_x = fake.x[:t].float() * fake.x_sf[:t].repeat_interleave(128, -1)
    # x * (1/s) on the GPU vs x / s here: a rare last-bit difference moves one FP8 step
    mismatch = (buf.x[:t].view(torch.uint8).cpu() != fake.x[:t].view(torch.uint8)).float().mean()
    assert mismatch < 1e-3 and float((real_x - fake_x).norm() / fake_x.norm()) < 1e-3
    assert torch.equal(buf.topk_idx.cpu(), fake.topk_idx) and torch.equal(
        buf.topk_weights.cpu(), fake.topk_weights
    )
    assert torch.all(buf.topk_idx[t:] == -1)


@pytest.mark.parametrize("clamp", [None, 0.75])
def test_fake_sm90_kernel_computes_what_the_real_one_does(dg, clamp: float | None) -> None:  # type: ignore[no-untyped-def]
    from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8

    t, hidden, inter, e, topk = 24, 512, 256, 8, 2
    _, _, _, buf, fake_buf = _staged(dg, t, hidden, topk, e, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    q13, s13 = block_quant_weight_fp8(
        torch.randn(e, 2 * inter, hidden, device="cuda", generator=gen) * 0.05, (128, 128)
    )
    q2, s2 = block_quant_weight_fp8(
        torch.randn(e, hidden, inter, device="cuda", generator=gen) * 0.05, (128, 128)
    )
    l1, l2 = dg.transform_weights_for_mega_moe_sm90((q13, s13), (q2, s2))
    y = torch.full((t, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    kw = {} if clamp is None else {"activation_clamp": clamp}
    dg.fp8_mega_moe(y, l1, l2, buf, **kw)
    ref = torch.empty(t, hidden, dtype=torch.bfloat16)
    cpu = lambda p: (p[0].cpu(), p[1].cpu())
    reference_sm90_mega_moe(ref, cpu(l1), cpu(l2), fake_buf, activation_clamp=clamp)
    err = float((y.float().cpu() - ref.float()).norm() / ref.float().norm())
    assert torch.isfinite(y).all() and err < 4e-2, (
        err
    )  # the real kernel requantises the intermediate to FP8


def _probe_in(site: str, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.path.join(os.getcwd(), "python")])}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return out.stdout + out.stderr


@pytest.fixture
def wrong_site() -> str:
    site = os.environ.get("SGLANG_TEST_WRONG_DEEP_GEMM_SITE")
    if not site or not os.path.isdir(site):
        pytest.skip("no wrong-torch DeepGEMM wheel installed (scripts/device_check.sh sets one up)")
    return site


def test_wrong_torch_wheel_is_refused_before_import(wrong_site: str) -> None:
    out = _probe_in(
        wrong_site,
        "import sys; from sglang.srt.layers.deep_gemm_adapter import deep_gemm_status as s; "
        "st = s(); print('USABLE', st.usable, st.reason); print('IMPORTED', 'deep_gemm' in "
        "sys.modules)",
    )
    assert (
        "USABLE False" in out and "was built for torch 2.13" in out and "IMPORTED False" in out
    ), out
    assert out.count("DeepGEMM unusable") == 1, out


def test_wrong_torch_wheel_fails_the_self_check_without_the_release_table(wrong_site: str) -> None:
    out = _probe_in(
        wrong_site,
        "from sglang.srt.layers.deep_gemm_adapter import _probe; "
        "st = _probe('deep_gemm', check_release=False); print('USABLE', st.usable, st.reason)",
    )
    assert "USABLE False" in out and "self-check GEMM" in out and "built for torch 2.13" in out, out


if __name__ == "__main__":
    run_this_file(__file__)
