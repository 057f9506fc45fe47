"""The reserved-SM control for DeepGEMM's MegaMoE kernel, against a fake DeepGEMM on CPU."""

from __future__ import annotations

import threading

import pytest

from sglang.srt.environ import EnvValueError, envs
from sglang.srt.layers.deep_gemm_adapter import deep_gemm_call_guard
from sglang.srt.layers.moe import mega_moe, sm_budget
from sglang.srt.layers.moe.mega_moe import (  # the seed's names stay importable from mega_moe
    _configure_mega_moe_deep_gemm_num_sms,
    _get_mega_moe_symm_buffer,
    _mega_moe_max_num_sms,
    mega_moe_sm_budget,
)
from sglang.srt.utils.device import DeviceSMInfo
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_deep_gemm import FakeDeepGemm
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)

RESERVED = envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS


def _use_devices(monkeypatch: pytest.MonkeyPatch, devices: dict[int, tuple[int, int]]) -> None:
    """Pretend the process sees GPUs {index: (num_sms, arch)}; device None means index 0."""

    def fake_info(device: object = None) -> DeviceSMInfo:
        index = 0 if device is None else int(device)  # type: ignore[call-overload]
        sms, arch = devices[index]
        return DeviceSMInfo(index, sms, (arch // 10, arch % 10))

    monkeypatch.setattr(sm_budget, "device_sm_info", fake_info)


@pytest.fixture(autouse=True)
def _blackwell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RESERVED.name, raising=False)
    _use_devices(monkeypatch, {0: (132, 100)})
    mega_moe.clear_mega_moe_symm_buffers()


def test_default_reserve_narrows_132_to_130_and_restores() -> None:
    dg = FakeDeepGemm(num_sms=132)
    with _configure_mega_moe_deep_gemm_num_sms(dg) as effective:
        assert effective == 130
        assert dg.get_num_sms() == 130
    assert dg.get_num_sms() == 132
    assert dg.set_calls() == [130, 132]


def test_reserve_zero_makes_no_call() -> None:
    dg = FakeDeepGemm(num_sms=132)
    with RESERVED.override(0):
        assert _mega_moe_max_num_sms() is None
        with _configure_mega_moe_deep_gemm_num_sms(dg) as effective:
            assert effective is None
            assert dg.get_num_sms() == 132
    assert dg.calls == []


def test_reserve_larger_than_gpu_clamps_to_two() -> None:
    dg = FakeDeepGemm(num_sms=132)
    with RESERVED.override(200):
        assert _mega_moe_max_num_sms() == 2
        with _configure_mega_moe_deep_gemm_num_sms(dg):
            assert dg.get_num_sms() == 2
    assert dg.get_num_sms() == 132


@pytest.mark.parametrize(("reserve", "want"), [(3, 128), (1, 130), (5, 126), (2, 130)])
def test_odd_budgets_round_down_to_even(reserve: int, want: int) -> None:
    dg = FakeDeepGemm(num_sms=132)
    with RESERVED.override(reserve):
        assert _mega_moe_max_num_sms() == want
        with _configure_mega_moe_deep_gemm_num_sms(dg):
            assert dg.get_num_sms() == want


def test_odd_physical_count_rounds_down(monkeypatch: pytest.MonkeyPatch) -> None:
    _use_devices(monkeypatch, {0: (133, 100)})
    assert _mega_moe_max_num_sms() == 130


def test_outer_context_value_is_never_raised() -> None:
    dg = FakeDeepGemm(num_sms=100)  # e.g. two-batch overlap already narrowed DeepGEMM
    with _configure_mega_moe_deep_gemm_num_sms(dg) as effective:
        assert effective == 100
        assert dg.get_num_sms() == 100
    assert dg.calls == []
    odd = FakeDeepGemm(num_sms=101)
    with _configure_mega_moe_deep_gemm_num_sms(odd):
        assert odd.get_num_sms() == 100
    assert odd.get_num_sms() == 101


def test_nested_contexts_restore_in_order() -> None:
    dg = FakeDeepGemm(num_sms=132)
    with _configure_mega_moe_deep_gemm_num_sms(dg), RESERVED.override(10):
        with _configure_mega_moe_deep_gemm_num_sms(dg):
            assert dg.get_num_sms() == 122
        assert dg.get_num_sms() == 130
    assert dg.get_num_sms() == 132


def test_restored_when_body_raises() -> None:
    dg = FakeDeepGemm(num_sms=132)
    with (
        pytest.raises(RuntimeError, match="kernel failed"),
        _configure_mega_moe_deep_gemm_num_sms(dg),
    ):
        assert dg.get_num_sms() == 130
        raise RuntimeError("kernel failed")
    assert dg.get_num_sms() == 132


def test_sm90_is_narrowed_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepGEMM 0.1.5.post1's SM90 fp8_mega_moe is a whole-grid launch (measured stalling
    behind a one-SM side-stream kernel at 132 SMs, not at 130): the reserve applies there."""
    _use_devices(monkeypatch, {0: (132, 90)})
    dg = FakeDeepGemm(num_sms=132)
    assert _mega_moe_max_num_sms() == 130
    with _configure_mega_moe_deep_gemm_num_sms(dg) as effective:
        assert effective == 130 and dg.get_num_sms() == 130
    assert dg.set_calls() == [130, 132]


def test_no_reservation_where_deep_gemm_has_no_mega_moe(monkeypatch: pytest.MonkeyPatch) -> None:
    _use_devices(monkeypatch, {0: (108, 80)})
    dg = FakeDeepGemm(num_sms=108)
    assert _mega_moe_max_num_sms() is None
    with _configure_mega_moe_deep_gemm_num_sms(dg):
        assert dg.get_num_sms() == 108
    assert dg.calls == []
    # The architecture-independent budget still exists for whole-grid kernels of our own.
    assert mega_moe_sm_budget() == 106


def test_budget_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _use_devices(monkeypatch, {0: (148, 100), 1: (132, 100)})
    assert _mega_moe_max_num_sms(0) == 146
    assert _mega_moe_max_num_sms(1) == 130


def test_bad_env_value_is_named_and_leaves_count_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    dg = FakeDeepGemm(num_sms=132)
    for raw in ("abc", "-3", "1.5"):
        monkeypatch.setenv(RESERVED.name, raw)
        with (
            pytest.raises(
                EnvValueError, match=f"SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS={raw!r}"
            ),
            _configure_mega_moe_deep_gemm_num_sms(dg),
        ):
            pass
    assert dg.calls == [] and dg.get_num_sms() == 132


def test_two_threads_do_not_see_each_others_value() -> None:
    """Thread A narrows the count and stays inside; thread B's guarded DeepGEMM call must run
    with the original value, and B's own MegaMoE context must not restore A's value."""
    dg = FakeDeepGemm(num_sms=132)
    inside = threading.Event()
    release = threading.Event()
    seen: dict[str, int] = {}

    def a() -> None:
        with _configure_mega_moe_deep_gemm_num_sms(dg):
            seen["a_inside"] = dg.get_num_sms()
            inside.set()
            release.wait(timeout=5)
            seen["a_after_wait"] = dg.get_num_sms()

    def b() -> None:
        inside.wait(timeout=5)
        with deep_gemm_call_guard():
            seen["b_plain_call"] = dg.get_num_sms()
        with RESERVED.override(4), _configure_mega_moe_deep_gemm_num_sms(dg):
            seen["b_inside"] = dg.get_num_sms()

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start()
    tb.start()
    inside.wait(timeout=5)
    release.set()
    ta.join(timeout=10)
    tb.join(timeout=10)
    assert not ta.is_alive() and not tb.is_alive()
    assert seen == {"a_inside": 130, "a_after_wait": 130, "b_plain_call": 132, "b_inside": 128}
    assert dg.get_num_sms() == 132


BUFFER_ARGS = {
    "num_experts": 256,
    "num_max_tokens_per_rank": 1024,
    "num_topk": 8,
    "hidden": 7168,
    "intermediate_hidden": 2048,
    "activation": "swiglu",
    "mma_type": "fp8xfp4",
}


def test_buffer_is_keyed_by_layout_only_and_made_on_the_original_count() -> None:
    dg = FakeDeepGemm(num_sms=132)
    group = object()
    first = _get_mega_moe_symm_buffer(dg, group, **BUFFER_ARGS)
    with RESERVED.override(8):
        second = _get_mega_moe_symm_buffer(dg, group, **BUFFER_ARGS)
    with RESERVED.override(0):
        third = _get_mega_moe_symm_buffer(dg, group, **BUFFER_ARGS)
    assert first is second is third
    assert first.num_sms_at_creation == 132, "set-up runs on the original count"
    assert [name for name, _ in dg.calls] == ["get_symm_buffer_for_mega_moe"]


@pytest.mark.parametrize(
    "change",
    [
        {"num_experts": 384},
        {"num_max_tokens_per_rank": 2048},
        {"num_topk": 16},
        {"hidden": 3584},
        {"intermediate_hidden": 3072},
        {"activation": "situ"},
        {"mma_type": "fp8"},
    ],
)
def test_buffer_cache_misses_on_layout_parameters(change: dict[str, object]) -> None:
    dg = FakeDeepGemm(num_sms=132)
    group = object()
    base = _get_mega_moe_symm_buffer(dg, group, **BUFFER_ARGS)
    other = _get_mega_moe_symm_buffer(dg, group, **{**BUFFER_ARGS, **change})  # type: ignore[arg-type]
    assert other is not base
    assert _get_mega_moe_symm_buffer(dg, object(), **BUFFER_ARGS) is not base, "group is in key"


if __name__ == "__main__":
    run_this_file(__file__)
