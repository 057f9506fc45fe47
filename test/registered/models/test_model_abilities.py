"""The executor reaches a model only through declared abilities (model_executor/model_abilities):
DeepSeek V4, the built-in default model and Kimi K3 are ``ServedModel``s and
``SupportsStaticDecode`` (Kimi K3's behind its gate, ``GatedStaticDecode``); the MoE runners are
reached through ``moe_layers()``, never by probing module attributes, and a model lacking an
ability is refused with its name."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.default_model.generate import ensure_default_model
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.layers.moe.moe_runner.torch_runner import TorchMoERunner
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, graph_unavailable_reason
from sglang.srt.model_executor.model_abilities import (
    GatedStaticDecode,
    ServedModel,
    SupportsMemoryModel,
    SupportsSlotPool,
    SupportsStaticDecode,
    missing_ability_reason,
    moe_runners,
    require_ability,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import CONFIG_A as DSV4_CONFIG
from sglang.test.kimi_k3_tiny import CONFIG_A as KIMI_CONFIG
from sglang.test.kimi_k3_tiny import config as kimi_config
from sglang.test.run import run_this_file

register_cpu_ci(est_time=8)

CUDA = torch.device("cuda")  # graph_unavailable_reason only reads the type


def _dsv4() -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4ModelConfig.from_dict({**DSV4_CONFIG, "model_type": "deepseek_v4"})
    return DeepseekV4ForCausalLM(cfg, LayerBuildSpec(dtype=torch.float32, moe_runner="torch"))


def _kimi() -> KimiK3ForCausalLM:
    return KimiK3ForCausalLM(
        kimi_config(KIMI_CONFIG), LayerBuildSpec(dtype=torch.float32, moe_runner="torch")
    )


def test_the_three_models_declare_their_abilities() -> None:
    dsv4, kimi = _dsv4(), _kimi()
    default = ModelRunner(
        ServerArgs(model_path=ensure_default_model(), device="cpu").resolved(), 0, 1
    )
    for model in (dsv4, kimi, default.model):
        assert isinstance(model, ServedModel), type(model).__name__
    for model in (dsv4, kimi, default.model):
        assert isinstance(model, SupportsStaticDecode) and isinstance(model, SupportsSlotPool)
    # Kimi K3's static decode is gated (SGLANG_K3_STATIC_DECODE), DeepSeek V4's is not.
    assert isinstance(kimi, GatedStaticDecode) and not isinstance(dsv4, GatedStaticDecode)
    # Each offers its memory model (the default --max-total-tokens is then a measured bound).
    for model in (dsv4, kimi, default.model):
        assert isinstance(model, SupportsMemoryModel), type(model).__name__
    # moe_layers: every FusedMoE, in order, and only those
    for model in (dsv4, kimi):
        layers = list(model.moe_layers())
        assert layers and layers == [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert all(isinstance(r, TorchMoERunner) for r in moe_runners(model))
    assert default.moe_runner_name() == "torch"  # auto on CPU, read through moe_layers()
    assert default.mega_moe_backend() is None  # a2a none: no fused kernel


def test_a_missing_ability_is_refused_by_name() -> None:
    class EagerOnly(torch.nn.Module):
        def moe_layers(self) -> list[FusedMoE]:
            return []

    model = EagerOnly()
    why = missing_ability_reason(model, SupportsStaticDecode)
    assert why is not None and why.startswith(
        "EagerOnly does not implement SupportsStaticDecode (missing: "
    )
    assert "static_decode" in why and "enable_slot_pool" in why and "forward" not in why
    with pytest.raises(TypeError, match="EagerOnly does not implement SupportsStatic"):
        CudaGraphRunner(model, [1], torch.device("cpu"))
    assert graph_unavailable_reason(model, CUDA, disabled=False) == (  # type: ignore[arg-type]
        "EagerOnly has no static decode; decode runs eagerly"
    )
    with pytest.raises(TypeError, match=r"object does not implement ServedModel \(missing: "):
        require_ability(object(), ServedModel)


def test_kimi_k3_static_decode_is_gated(monkeypatch: pytest.MonkeyPatch) -> None:
    kimi = _kimi()
    monkeypatch.setenv("SGLANG_K3_STATIC_DECODE", "0")
    why = graph_unavailable_reason(kimi, CUDA, disabled=False)
    assert why is not None and why.startswith("SGLANG_K3_STATIC_DECODE is off")
    monkeypatch.setenv("SGLANG_K3_STATIC_DECODE", "1")
    # Gate open: the graphs are refused only for the MoE runner's host sync (torch runner).
    assert graph_unavailable_reason(kimi, CUDA, disabled=False) == (
        TorchMoERunner.capture_unsafe_reason
    )


def test_a_lone_static_decode_method_is_not_the_ability() -> None:
    """A model with ``static_decode`` but no slot pool: a probe for the method would take it."""

    class HalfModel(torch.nn.Module):
        def static_decode(self, *args: torch.Tensor) -> torch.Tensor:
            raise AssertionError("must not run")

    half = HalfModel()
    assert not isinstance(half, SupportsStaticDecode)
    why = missing_ability_reason(half, SupportsStaticDecode)
    assert why is not None and "enable_slot_pool" in why and "static_decode" not in why


def test_the_graph_check_reads_runners_through_moe_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _dsv4()
    assert graph_unavailable_reason(model, CUDA, disabled=False) == (
        TorchMoERunner.capture_unsafe_reason
    )
    # The runners are still attributes of the modules; the declared accessor hides them. A scan
    # of module attributes would still find the torch runner.
    monkeypatch.setattr(model, "moe_layers", lambda: iter(()))
    assert graph_unavailable_reason(model, CUDA, disabled=False) is None


if __name__ == "__main__":
    run_this_file(__file__)
