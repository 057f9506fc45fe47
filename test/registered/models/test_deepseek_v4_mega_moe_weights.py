"""DeepSeek V4 with MXFP4 experts end to end on the MegaMoE path, on CPU: the loader's post-load
step lays every layer's experts out for DeepGEMM (``build_mega_moe_experts_weights`` through the
fake ``transform_sf_into_required_layout``), the fake ``fp8_fp4_mega_moe`` reads that layout back,
and the model gives the normal path's results.

What "the same" means: the MegaMoE path stages each MoE input as FP8 e4m3 with a power-of-two
scale per 32 values and returns bf16 rows. So the reference is the normal path run with that same
numerics (its input staged the same way, its output rounded to bf16):
- every layer's MegaMoE output equals the normal layer's on the same staged input to bf16
  rounding (rtol 1e-2);
- the logits agree to 5% of their range: the remaining difference is fp32 summation order
  flipping a few bf16 roundings, which a tiny random model's discrete choices (indexer and router
  top-k) amplify. Without emulating the staging, those choices amplify FP8's ~2% input error to
  logit differences of order 1 on the hash/YaRN config, so that comparison cannot be tight.
A wrong layout (rows not interleaved, scales not transposed) gives errors of order 1 in every
layer (the unit tests check that)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.deepseek_v4_moe import DeepseekV4MoE
from sglang.srt.models.loading import load_weights
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import (
    CONFIG_A,
    CONFIG_C,
    MEGA_SHAPES,
    mxfp4_release_checkpoint,
    reference_model,
    rel_err,
    token_ids,
)
from sglang.test.fake_mega_moe import fp8_staged, install_fake_mega_moe
from sglang.test.run import run_this_file

register_cpu_ci(est_time=10)


def _model(
    overrides: dict[str, Any], ckpt: dict[str, torch.Tensor], a2a: str
) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict({**overrides, "model_type": "deepseek_v4"}),
        LayerBuildSpec(dtype=torch.float32, moe_runner="torch", a2a_backend=a2a),
    )
    load_weights(model, ckpt, LoadOptions(progress=False))
    return model.eval()


def _kernel_numerics(model: DeepseekV4ForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``model``'s (normal-path) experts with the MegaMoE kernel's input staging and bf16
    output."""
    for layer in model.decoder_layers:
        experts = layer.ffn.experts
        run = experts.forward
        monkeypatch.setattr(
            experts,
            "forward",
            lambda x, topk, run=run, **kw: run(fp8_staged(x), topk, **kw).bfloat16().to(x.dtype),
        )


@pytest.mark.parametrize("base", [CONFIG_A, CONFIG_C], ids=["hash+yarn", "two-streams"])
def test_mega_path_with_built_weights_matches_normal_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, base: dict[str, Any]
) -> None:
    overrides = {**base, **MEGA_SHAPES}
    ckpt = mxfp4_release_checkpoint(reference_model(overrides, seed=7).state_dict())
    ids = token_ids(12, overrides["vocab_size"], seed=8)
    normal = _model(overrides, ckpt, "none")

    rec = install_fake_mega_moe(monkeypatch, cap=32)
    monkeypatch.setattr(logging.getLogger("sglang"), "propagate", True)  # caplog hooks the root
    with caplog.at_level(logging.INFO, logger="sglang"):
        mega = _model(overrides, ckpt, "megamoe")
    layers = overrides["num_hidden_layers"]
    assert any(
        f"built DeepGEMM MegaMoE expert weights for {layers} of {layers}" in r.getMessage()
        for r in caplog.records
    )
    seen: list[tuple[torch.Tensor, Any, torch.Tensor]] = []
    for layer in mega.decoder_layers:
        (l1, l1_sf), _ = layer.ffn.experts.mega_weights
        assert l1.dtype == torch.int8 and l1_sf.dtype == torch.int32 and l1_sf.stride(1) == 1
        run = layer.ffn.experts.a2a.run_mega_moe  # what the MegaMoE call site runs

        def record(
            x: torch.Tensor, topk: TopKOutput, weights: Any, kernel: Any, run: Any = run
        ) -> Any:
            y = run(x, topk, weights, kernel)
            seen.append((x.clone(), topk, y))
            return y

        monkeypatch.setattr(layer.ffn.experts.a2a, "run_mega_moe", record)
    call_sites: list[int] = []
    site = DeepseekV4MoE._run_mega_routed

    def counted(self: DeepseekV4MoE, *args: Any) -> torch.Tensor:
        call_sites.append(self.layer_id)
        return site(self, *args)

    monkeypatch.setattr(DeepseekV4MoE, "_run_mega_routed", counted)
    with torch.no_grad():
        got = mega(ids, torch.arange(12))
    assert call_sites == list(range(layers))  # the forward goes through the MegaMoE call site
    names = [n for n, _ in rec.dg.calls]
    assert (
        names.count("fp8_fp4_mega_moe") == layers
        and names.count("transform_sf_into_required_layout") == 2 * layers
    )
    assert rec.all_reduces == []

    # each layer: the kernel's rows == the normal layer's on the same staged input
    assert len(seen) == layers
    for i, (x, topk, y) in enumerate(seen):
        with torch.no_grad():
            want = normal.decoder_layers[i].ffn.experts(fp8_staged(x), topk)
        torch.testing.assert_close(
            y.float(), want, rtol=1e-2, atol=1e-3, msg=lambda m, i=i: f"layer {i}: {m}"
        )
    # the whole model: against the normal path with the kernel's numerics
    _kernel_numerics(normal, monkeypatch)
    with torch.no_grad():
        want = normal(ids, torch.arange(12))
    err = rel_err(got, want)
    assert err < 5e-2, err


def test_bf16_experts_keep_the_normal_path_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    overrides = {**CONFIG_C, **MEGA_SHAPES}
    state = reference_model(overrides, seed=3).state_dict()  # stacked fp32 experts: no mega layout
    install_fake_mega_moe(monkeypatch, cap=32)
    monkeypatch.setattr(logging.getLogger("sglang"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="sglang"):
        model = _model(overrides, state, "megamoe")
    assert all(layer.ffn.experts.mega_weights is None for layer in model.decoder_layers)
    assert any(
        "MegaMoE weights are not built (bf16 experts)" in r.getMessage() for r in caplog.records
    )


if __name__ == "__main__":
    run_this_file(__file__)
