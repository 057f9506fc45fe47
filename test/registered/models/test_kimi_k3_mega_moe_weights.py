"""Kimi K3's latent MoE on the MegaMoE path with real (built) weights, on CPU: MXFP4 experts laid
out by ``build_mega_moe_experts_weights`` (directly, and by the loader's post-load step from an
MXFP4 checkpoint), read back by the fake ``fp8_fp4_mega_moe`` with SiTU, give the normal path's
result.

The kernel stages the latent as FP8 e4m3 with a power-of-two scale per 32 values and returns bf16
rows, so the tight reference is the normal path with that numerics (staged input, bf16 output);
against the plain normal path the difference is FP8-sized (a few percent)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.srt.models.loading import load_weights
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_mega_moe import fp8_staged, install_fake_mega_moe, mxfp4_mega_experts
from sglang.test.kimi_k3_tiny import (
    CONFIG_A,
    config,
    make_model,
    random_experts,
    randomize_,
    tokens,
)
from sglang.test.release_checkpoint import kimi_k3 as k3_release
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_norm_err

register_cpu_ci(est_time=10)

# MegaMoE's shapes: latent a multiple of 512, expert width a multiple of 128.
MEGA: dict[str, Any] = {
    **CONFIG_A,
    "routed_expert_hidden_size": 512,
    "moe_intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_token": 2,
}


def _kernel_numerics(experts: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Normal-path experts with the MegaMoE kernel's input staging and bf16 output."""
    run = experts.forward
    monkeypatch.setattr(
        experts,
        "forward",
        lambda z, topk, **kw: run(fp8_staged(z), topk, **kw).bfloat16().to(z.dtype),
    )


def test_latent_moe_block_mega_path_equals_normal_path(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = install_fake_mega_moe(monkeypatch, cap=16)
    blocks = {}
    for a2a in ("none", "megamoe"):
        blocks[a2a] = KimiK3MoE(
            config(MEGA),
            LayerBuildSpec(dtype=torch.float32, moe_runner="torch", a2a_backend=a2a),
        )
        randomize_(blocks[a2a], seed=4)
    rounded, mega = mxfp4_mega_experts(rec.dg, random_experts(blocks["none"], seed=4))
    for block in blocks.values():
        block.experts.load_weights(rounded)
    blocks["megamoe"].experts.set_mega_weights(mega)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = blocks["megamoe"](x)
        plain = blocks["none"](x)
        _kernel_numerics(blocks["none"].experts, monkeypatch)
        want = blocks["none"](x)
    kernel = [v for n, v in rec.dg.calls if n == "fp8_fp4_mega_moe"]
    assert len(kernel) == 1 and kernel[0][1]["activation"] == "situ"
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
    assert 1e-3 < rel_norm_err(got, plain) < 5e-2


def test_loader_builds_mega_weights_and_logits_match(monkeypatch: pytest.MonkeyPatch) -> None:
    # MXFP4 experts in the release naming
    ckpt = dict(k3_release.model_release_tensors(make_model(MEGA, seed=6)).tensors)
    ids = tokens(10, seed=7)

    def loaded(a2a: str) -> KimiK3ForCausalLM:
        model = KimiK3ForCausalLM(
            config(MEGA), LayerBuildSpec(dtype=torch.float32, moe_runner="torch", a2a_backend=a2a)
        )
        load_weights(model, ckpt, LoadOptions(progress=False))
        return model.eval()

    normal = loaded("none")
    with torch.no_grad():
        plain = normal(ids, torch.arange(10))
    rec = install_fake_mega_moe(monkeypatch, cap=16)
    mega = loaded("megamoe")
    moe_layers = [layer.mlp for layer in mega.decoder_layers if isinstance(layer.mlp, KimiK3MoE)]
    assert moe_layers and all(m.experts.mega_weights is not None for m in moe_layers)
    with torch.no_grad():
        got = mega(ids, torch.arange(10))
    assert [n for n, _ in rec.dg.calls].count("fp8_fp4_mega_moe") == len(moe_layers)
    for layer in normal.decoder_layers:
        if isinstance(layer.mlp, KimiK3MoE):
            _kernel_numerics(layer.mlp.experts, monkeypatch)
    with torch.no_grad():
        want = normal(ids, torch.arange(10))
    # FP8 e4m3 keeps 3 mantissa bits, so one staged value on the other side of a rounding step
    # (an fp32 sum-order difference) moves the logits by ~1%; the plain path is ~20% away.
    tight, loose = rel_norm_err(got, want), rel_norm_err(got, plain)
    assert tight < 3e-2 and tight < 0.15 * loose, (tight, loose)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


if __name__ == "__main__":
    run_this_file(__file__)
