"""DeepSeek V4 and Kimi K3 with MXFP4 experts through the loaders, on CPU.

- bf16 model: the experts stay packed (0.53 bytes a parameter) and the torch runner dequantises
  the experts a batch routes to on use; logits and greedy tokens equal, bit for bit, the model
  loaded from the same checkpoint with its experts dequantised to bf16 (the reference). fp32
  (the exactness check): the experts are dequantised at load, logits equal the fp32 reference.
- ``--moe-a2a-backend megamoe`` on a (fake) Blackwell: the MXFP4 layout built for
  ``fp8_fp4_mega_moe`` is the only resident copy, the same tensors the kernel reads; batches the
  kernel does not take read their experts from it and equal the normal path exactly.
- on a (fake) Hopper: MXFP4 is converted to FP8 128x128 at load (every block exact, logged), the
  FP8 layout built for ``fp8_mega_moe`` is the only copy, the kernel on it equals the torch
  oracle on the dequantised MXFP4 experts, and the fallback equals the runner on the converted
  experts.
- the load report: routed experts resident against the checkpoint bytes of the rank's share.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch

from sglang.kernels.ops.moe.fused_moe import fused_experts_torch
from sglang.kernels.ops.quant.fp8 import per_token_group_quant_fp8
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.expert_plan import Conversion
from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.layers.quantization.mxfp4 import dequant_mxfp4
from sglang.srt.mem_cache.memory_models.weight_bytes import resident_vs_checkpoint
from sglang.srt.model_loader.checkpoint_loop import LoadReport
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.loading import load_weights
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import (
    CONFIG_C,
    MEGA_SHAPES,
    mxfp4_release_checkpoint,
    reference_model,
    token_ids,
)
from sglang.test.fake_mega_moe import fp8_staged, install_fake_mega_moe
from sglang.test.kimi_k3_tiny import CONFIG_A as K3_CONFIG
from sglang.test.kimi_k3_tiny import CONFIG_MEGA as K3_MEGA_CONFIG
from sglang.test.kimi_k3_tiny import config as k3_config
from sglang.test.kimi_k3_tiny import make_model as k3_make_model
from sglang.test.kimi_k3_tiny import tokens as k3_tokens
from sglang.test.release_checkpoint import kimi_k3 as k3_release
from sglang.test.run import run_this_file

register_cpu_ci(est_time=40)

DSV4 = {**CONFIG_C, **MEGA_SHAPES, "model_type": "deepseek_v4"}  # hidden and I 128: MegaMoE tiles


def dequantised(
    ckpt: dict[str, torch.Tensor], packed: str, scale: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``ckpt`` with every MXFP4 expert tensor (``...{packed}`` + ``...{scale}``) replaced by its
    dequantised values in ``dtype`` under ``....weight``: the reference checkpoint."""
    out: dict[str, torch.Tensor] = {}
    for name, t in ckpt.items():
        if name.endswith(scale) and name.removesuffix(scale) + packed in ckpt:
            continue
        if name.endswith(packed) and t.dtype in (torch.uint8, torch.int8):
            base = name.removesuffix(packed)
            s = ckpt[base + scale].view(torch.uint8)
            out[base + ".weight"] = dequant_mxfp4(t, s, torch.float32).to(dtype)
            continue
        out[name] = t
    return out


@functools.cache
def dsv4_checkpoint() -> dict[str, torch.Tensor]:
    return mxfp4_release_checkpoint(reference_model(DSV4, seed=7).state_dict())


def dsv4(
    ckpt: dict[str, torch.Tensor], dtype: torch.dtype, a2a: str = "none"
) -> tuple[DeepseekV4ForCausalLM, LoadReport]:
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict(DSV4),
        LayerBuildSpec(dtype=dtype, moe_runner="torch", a2a_backend=a2a),
    )
    report = load_weights(model, ckpt, LoadOptions(progress=False))
    return model.eval(), report


@torch.no_grad()
def greedy(model: Any, prompt: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (each step recomputes the whole sequence) and the prompt's logits."""
    ids = prompt.clone()
    first = model(ids, torch.arange(ids.numel()))
    for _ in range(steps):
        logits = model(ids, torch.arange(ids.numel()))
        ids = torch.cat([ids, logits[-1].argmax().view(1)])
    return ids[prompt.numel() :].tolist(), first


def _routed_ratios(report: LoadReport) -> list[float]:
    """Resident / checkpoint bytes of the routed experts, per MoE layer."""
    rows = resident_vs_checkpoint(
        report.resident.only("routed_experts"), report.checkpoint.only("routed_experts")
    )[:-1]
    assert rows
    return [r.ratio for r in rows]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dsv4_mxfp4_engine_equals_the_dequantised_reference(dtype: torch.dtype) -> None:
    ckpt = dsv4_checkpoint()
    model, report = dsv4(ckpt, dtype)
    ref, _ = dsv4(dequantised(ckpt, ".weight", ".scale", dtype), dtype)
    for layer in model.decoder_layers:
        w, plan = layer.ffn.experts.weights, layer.ffn.experts.expert_plan
        assert w is not None and plan is not None
        if dtype == torch.bfloat16:
            assert w.is_mxfp4 and w.w13.dtype == torch.uint8  # kept packed, no bf16 copy
        else:
            assert w.w13.dtype == torch.float32 and plan.conversion is Conversion.DEQUANTISE
    prompt = token_ids(8, DSV4["vocab_size"], seed=8)
    steps = 3 if dtype == torch.bfloat16 else 0  # fp32: the logits say it all
    got_tokens, got = greedy(model, prompt, steps)
    want_tokens, want = greedy(ref, prompt, steps)
    assert torch.equal(got, want)
    assert got_tokens == want_tokens
    if dtype == torch.bfloat16:
        assert max(_routed_ratios(report)) <= 1.0  # exactly the packed bytes and scales
        assert report.resident.by_group()["routed_experts"].keys() == {"mxfp4"}


@functools.cache
def k3_checkpoint(raw_key: str) -> dict[str, torch.Tensor]:
    raw = K3_CONFIG if raw_key == "tiny" else K3_MEGA_CONFIG
    return dict(k3_release.model_release_tensors(k3_make_model(raw, seed=5)).tensors)


def k3(
    ckpt: dict[str, torch.Tensor], dtype: torch.dtype, raw: dict[str, Any], a2a: str = "none"
) -> tuple[KimiK3ForCausalLM, LoadReport]:
    model = KimiK3ForCausalLM(
        k3_config(raw), LayerBuildSpec(dtype=dtype, moe_runner="torch", a2a_backend=a2a)
    )
    report = load_weights(model, ckpt, LoadOptions(progress=False))
    return model.eval(), report


def _k3_moe_layers(model: KimiK3ForCausalLM) -> list[FusedMoE]:
    return list(model.moe_layers())


def test_k3_mxfp4_engine_equals_the_dequantised_reference() -> None:
    # fp32 (dequantised at load) against the rounded model: test_kimi_k3_checkpoint
    dtype = torch.bfloat16
    ckpt = k3_checkpoint("tiny")
    model, report = k3(ckpt, dtype, K3_CONFIG)
    ref, _ = k3(dequantised(ckpt, ".weight_packed", ".weight_scale", dtype), dtype, K3_CONFIG)
    layers = _k3_moe_layers(model)
    assert layers and all(layer.config.activation == "situ" for layer in layers)
    for layer in layers:
        assert layer.weights is not None
        assert layer.weights.is_mxfp4
    prompt = k3_tokens(5, seed=3)
    got_tokens, got = greedy(model, prompt, 2)
    want_tokens, want = greedy(ref, prompt, 2)
    assert torch.equal(got, want)
    assert got_tokens == want_tokens
    assert max(_routed_ratios(report)) <= 1.0


def _batch(hidden: int, t: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, Any]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(t)]).int()
    return x, TopKOutput(torch.rand(t, top_k, generator=gen), ids)


def _check_single_copy(layer: FusedMoE) -> None:
    w = layer.weights
    assert w is not None and w.is_mega and layer.mega_weights_beside is None
    mega = layer.mega_weights
    assert mega is not None
    (l1, l1_sf), (l2, l2_sf) = mega
    assert l1 is w.w13 and l1_sf is w.w13_scale and l2 is w.w2 and l2_sf is w.w2_scale


def test_blackwell_megamoe_keeps_the_mxfp4_layout_as_the_only_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ckpt = dsv4_checkpoint()
    normal, _ = dsv4(ckpt, torch.bfloat16)
    rec = install_fake_mega_moe(monkeypatch, cap=8)
    mega, report = dsv4(ckpt, torch.bfloat16, "megamoe")
    for layer in mega.decoder_layers:
        _check_single_copy(layer.ffn.experts)
        assert layer.ffn.experts.weights is not None and layer.ffn.experts.weights.is_mxfp4
    # the MegaMoE layout holds exactly the checkpoint's bytes (int8 weights, int32 scale words)
    assert _routed_ratios(report) == [1.0] * len(mega.decoder_layers)
    assert report.resident.by_group()["routed_experts"].keys() == {"mxfp4 mega"}
    c = DeepseekV4ModelConfig.from_dict(DSV4)
    experts = mega.decoder_layers[0].ffn.experts
    x, topk = _batch(c.hidden_size, 4, c.n_routed_experts, c.num_experts_per_tok, seed=1)
    with torch.no_grad():
        experts(x, topk)
    assert [n for n, _ in rec.dg.calls].count("fp8_fp4_mega_moe") == 1
    # more rows than the kernel takes: the experts they route to, read from the same bytes
    x, topk = _batch(c.hidden_size, 20, c.n_routed_experts, c.num_experts_per_tok, seed=2)
    with torch.no_grad():
        got = experts(x, topk)
        want = normal.decoder_layers[0].ffn.experts(x, topk)
    assert torch.equal(got, want)
    assert [n for n, _ in rec.dg.calls].count("fp8_fp4_mega_moe") == 1


def test_hopper_megamoe_converts_to_fp8_and_keeps_its_layout_as_the_only_copy(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = dsv4_checkpoint()
    normal, _ = dsv4(ckpt, torch.bfloat16)
    rec = install_fake_mega_moe(monkeypatch, cap=8, arch=90)
    monkeypatch.setattr(logging.getLogger("sglang"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="sglang"):
        mega, report = dsv4(ckpt, torch.bfloat16, "megamoe")
    layers = len(mega.decoder_layers)
    line = next(
        r.getMessage() for r in caplog.records if "converted to FP8 128x128" in r.getMessage()
    )
    assert f"of {layers} MoE layers" in line and "for fp8_mega_moe" in line
    assert "every block exact" in line and "x)" in line
    for i, layer in enumerate(mega.decoder_layers):
        experts = layer.ffn.experts
        _check_single_copy(experts)
        w = experts.weights
        assert w is not None and w.is_fp8 and experts.expert_plan is not None
        assert experts.expert_plan.conversion is Conversion.MXFP4_TO_FP8
        # lossless: the FP8 experts are the MXFP4 ones, value for value
        packed = normal.decoder_layers[i].ffn.experts.weights
        assert packed is not None
        for a, b in zip(w.dequantized(torch.float32), packed.dequantized(torch.float32)):
            assert torch.equal(a, b)
    ratios = _routed_ratios(report)
    assert all(1.8 < r < 2.0 for r in ratios), ratios  # FP8 is ~2x MXFP4
    c = DeepseekV4ModelConfig.from_dict(DSV4)
    experts = mega.decoder_layers[1].ffn.experts
    reference = normal.decoder_layers[1].ffn.experts
    assert reference.weights is not None
    d13, d2 = reference.weights.dequantized(torch.bfloat16)
    x, topk = _batch(c.hidden_size, 6, c.n_routed_experts, c.num_experts_per_tok, seed=3)
    with torch.no_grad():
        got = experts(x, topk)
    assert [n for n, _ in rec.dg.calls].count("fp8_mega_moe") == 1
    limit = c.swiglu_limit
    # the oracle on the dequantised MXFP4 experts, fed the rows as the kernel stages them (FP8
    # with a scale per 128 values)
    q, scale = per_token_group_quant_fp8(x, 128, use_triton=False)
    staged = (q.float().view(6, -1, 128) * scale.unsqueeze(-1)).view(6, -1).bfloat16()
    oracle = fused_experts_torch(
        staged, d13, d2, topk.topk_weights, topk.topk_ids, activation="swiglu", swiglu_limit=limit
    )
    err = float((got.float() - oracle.float()).norm() / oracle.float().norm())
    assert err < 1e-2, err  # bf16 roundings of the staged rows and the intermediate
    # the fallback: the runner on the converted experts it selects from the same copy
    x, topk = _batch(c.hidden_size, 20, c.n_routed_experts, c.num_experts_per_tok, seed=4)
    assert experts.weights is not None
    std = experts.weights.standard()
    with torch.no_grad():
        got = experts(x, topk)
    want = fused_experts_torch(
        x, std.w13, std.w2, topk.topk_weights, topk.topk_ids, activation="swiglu",
        swiglu_limit=limit, w13_scale=std.w13_scale, w2_scale=std.w2_scale,
        block_shape=(128, 128),
    )  # fmt: skip
    assert torch.equal(got, want)


def test_k3_blackwell_megamoe_single_copy_runs_situ(monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = k3_checkpoint("mega")
    normal, _ = k3(ckpt, torch.bfloat16, K3_MEGA_CONFIG)
    rec = install_fake_mega_moe(monkeypatch, cap=8)
    mega, report = k3(ckpt, torch.bfloat16, K3_MEGA_CONFIG, "megamoe")
    layers = _k3_moe_layers(mega)
    for layer in layers:
        _check_single_copy(layer)
    assert _routed_ratios(report) == [1.0] * len(layers)
    experts, reference = layers[0], _k3_moe_layers(normal)[0]
    c = experts.config
    x, topk = _batch(c.hidden_size, 5, c.num_experts, c.top_k, seed=6)
    with torch.no_grad():
        got = experts(x, topk)
        want = reference(fp8_staged(x).bfloat16(), topk)  # the kernel stages its rows in FP8
    kernel = [v for n, v in rec.dg.calls if n == "fp8_fp4_mega_moe"]
    assert len(kernel) == 1 and kernel[0][1]["activation"] == "situ"
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < 1e-2, err  # fp32 in the fake kernel, bf16 intermediates in the runner
    x, topk = _batch(c.hidden_size, 12, c.num_experts, c.top_k, seed=7)  # past the cap
    with torch.no_grad():
        assert torch.equal(experts(x, topk), reference(x, topk))


if __name__ == "__main__":
    run_this_file(__file__)
