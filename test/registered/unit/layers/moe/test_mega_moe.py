"""The MegaMoE call path against a fake DeepGEMM: what runs inside the reserved-SM context (only
the kernel), what the pre-dispatch stages, and when it falls back to the normal path."""

from __future__ import annotations

import logging

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.moe import mega_moe, sm_budget
from sglang.srt.layers.moe.a2a.mega_moe_a2a import try_run_mega_routed
from sglang.srt.layers.moe.mega_moe import MegaMoEParams, mega_moe_pre_dispatch
from sglang.srt.utils.device import DeviceSMInfo
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_deep_gemm import FakeDeepGemmGemms, FakeMegaBuffer
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)

H, K, E = 256, 4, 16
WEIGHTS = ((torch.empty(0), torch.empty(0)), (torch.empty(0), torch.empty(0)))


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    for field in (
        envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS,
        envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK,
    ):
        monkeypatch.delenv(field.name, raising=False)
    monkeypatch.setenv(envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.name, "32")
    mega_moe.clear_mega_moe_symm_buffers()


def _arch(monkeypatch: pytest.MonkeyPatch, arch: int) -> None:
    info = lambda device=None: DeviceSMInfo(0, 132, (arch // 10, arch % 10))
    monkeypatch.setattr(mega_moe, "device_sm_info", info)
    monkeypatch.setattr(sm_budget, "device_sm_info", info)


def _batch(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, H, generator=gen) * 3).bfloat16()
    ids = torch.randint(0, E, (t, K), generator=gen, dtype=torch.int32)
    w = torch.rand(t, K, generator=gen)
    return x, ids, w


def test_blackwell_order_only_the_kernel_runs_on_the_narrowed_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _arch(monkeypatch, 100)
    dg = FakeDeepGemmGemms(num_sms=132)
    x, ids, w = _batch(5)
    params = MegaMoEParams(E, K, H, 512, activation="swiglu", activation_clamp=7.0)
    y = try_run_mega_routed(dg, "group", x, ids, w, WEIGHTS, params)
    assert y is not None and y.shape == (5, H) and torch.all(y == 1.0)
    names = [(n, v if n != "fp8_fp4_mega_moe" else v[0]) for n, v in dg.calls]
    assert names == [
        ("get_symm_buffer_for_mega_moe", 132),  # set-up on the original count
        ("set_num_sms", 130),
        ("fp8_fp4_mega_moe", 130),
        ("set_num_sms", 132),
    ]
    kwargs = dg.calls[2][1][1]
    assert kwargs == {
        "activation": "swiglu",
        "fast_math": True,
        "activation_clamp": 7.0,
        "recipe": (1, 1, 32),
    }
    assert dg.get_num_sms() == 132


def test_kimi_situ_has_no_clamp_and_buffer_is_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    _arch(monkeypatch, 100)
    dg = FakeDeepGemmGemms(num_sms=132)
    params = MegaMoEParams(E, K, H, 384, activation="situ")
    for t in (3, 7):
        x, ids, w = _batch(t, seed=t)
        assert try_run_mega_routed(dg, "g", x, ids, w, WEIGHTS, params) is not None
    kernel_calls = [v for n, v in dg.calls if n == "fp8_fp4_mega_moe"]
    assert [c[1]["activation"] for c in kernel_calls] == ["situ", "situ"]
    assert all("activation_clamp" not in c[1] for c in kernel_calls)
    assert [n for n, _ in dg.calls].count("get_symm_buffer_for_mega_moe") == 1


def test_sm90_pre_dispatch_outside_and_only_the_kernel_narrowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _arch(monkeypatch, 90)
    dg = FakeDeepGemmGemms(num_sms=132, arch=90)
    x, ids, w = _batch(4)
    y = try_run_mega_routed(
        dg, "g", x, ids, w, WEIGHTS, MegaMoEParams(E, K, H, 512, activation_clamp=7.0)
    )
    assert y is not None and torch.all(y == 2.0)
    names = [(n, v if n != "fp8_mega_moe" else v[0]) for n, v in dg.calls]
    assert names == [
        ("get_symm_buffer_for_mega_moe", 132),
        ("mega_moe_pre_dispatch_sm90", 132),
        ("set_num_sms", 130),
        ("fp8_mega_moe", 130),
        ("set_num_sms", 132),
    ]
    assert dg.calls[3][1][1] == {
        "recipe": (128, 128, 128),
        "activation": "swiglu",
        "fast_math": True,
        "activation_clamp": 7.0,
    }


@pytest.mark.parametrize(
    ("params", "why"),
    [
        (MegaMoEParams(E, K, H, 512, activation="situ"), "SwiGLU only"),
        (MegaMoEParams(E, K, H, 4224), "intermediate <= 4096"),
        (MegaMoEParams(E, K, 200, 512), "multiples of 128"),
    ],
)
def test_sm90_unsupported_shapes_fall_back_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    params: MegaMoEParams,
    why: str,
) -> None:
    _arch(monkeypatch, 90)
    dg = FakeDeepGemmGemms(num_sms=132, arch=90)
    x, ids, w = _batch(4)
    logging.getLogger("sglang").propagate = True
    with caplog.at_level(logging.WARNING, logger="sglang"):
        assert (
            try_run_mega_routed(dg, "g", x, ids, w, WEIGHTS, params) is None
        )  # no CUDA: no Triton either
    assert any(why in r.getMessage() for r in caplog.records)
    assert dg.calls == []


def test_pre_dispatch_quantises_copies_and_pads() -> None:
    cap, t = 8, 5
    buf = FakeMegaBuffer(
        x=torch.zeros(cap, H, dtype=torch.float8_e4m3fn),
        x_sf=torch.full((cap, H // 128), -7, dtype=torch.int32),
        topk_idx=torch.full((cap, K), 99, dtype=torch.int64),
        topk_weights=torch.full((cap, K), 5.0),
    )
    x, ids, w = _batch(t, seed=3)
    mega_moe_pre_dispatch(x, ids, w, buf, group_size=32)
    scale_bytes = buf.x_sf[:t].view(torch.uint8).view(t, H // 32)
    scales = torch.exp2(scale_bytes.float() - 127).repeat_interleave(32, -1)
    back = buf.x[:t].float() * scales
    assert float((back - x.float()).norm() / x.float().norm()) < 0.05
    # the scale is the smallest power of two that fits the group max into e4m3's 448
    group_max = x.float().view(t, H // 32, 32).abs().amax(-1)
    s = torch.exp2(scale_bytes.float() - 127)
    assert torch.all(group_max / s <= 448) and torch.all(group_max / s > 224)
    assert torch.equal(buf.topk_idx[:t], ids.long()) and torch.equal(buf.topk_weights[:t], w)
    assert torch.all(buf.topk_idx[t:] == -1) and torch.all(buf.topk_weights[t:] == 0)
    with pytest.raises(ValueError, match="exceed the MegaMoE buffer"):
        mega_moe_pre_dispatch(*_batch(cap + 1), buf)


def test_falls_back_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _arch(monkeypatch, 100)
    dg = FakeDeepGemmGemms(num_sms=132)
    params = MegaMoEParams(E, K, H, 512)
    logger = logging.getLogger("sglang")
    logger.propagate = True
    with caplog.at_level(logging.WARNING, logger="sglang"):
        x, ids, w = _batch(33)  # cap is 32
        assert try_run_mega_routed(dg, "g", x, ids, w, WEIGHTS, params) is None
        assert try_run_mega_routed(dg, "g", x, ids, w, WEIGHTS, params) is None
        assert try_run_mega_routed(None, "g", x[:2], ids[:2], w[:2], WEIGHTS, params) is None
        assert try_run_mega_routed(dg, "g", x[:2], ids[:2], w[:2], None, params) is None
    messages = [r.getMessage() for r in caplog.records if "MegaMoE falls back" in r.getMessage()]
    assert sum("NUM_MAX_TOKENS_PER_RANK=32" in m for m in messages) == 1
    assert any("DeepGEMM is unusable" in m for m in messages)
    assert any("weights were not built" in m for m in messages)
    assert dg.calls == [], "a fallback must not touch DeepGEMM"


if __name__ == "__main__":
    run_this_file(__file__)
