"""Tiny release-format checkpoints written by the test kit (``sglang.test.release_checkpoint``)
load through the engine's loaders and give the reference's fp32 logits on exactly the values
they stand for:

- DeepSeek V4 (FP8 128x128 dense weights with UE8M0 scales, MXFP4 experts, an MTP layer, shards),
  quantised from transformers' ``DeepseekV4ForCausalLM`` and drawn at random, against
  transformers run on the dequantised values (``to_transformers``);
- Kimi K3 (compressed-tensors MXFP4 experts, bf16 dense, the wrapper's names), quantised from our
  model and drawn at random, against the independent cache-free reference of
  ``test_kimi_k3`` on a model given the dequantised values by the naming rule alone
  (``into_model``: no loader involved).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.loading import load_model
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import (
    CONFIG_A,
    hf_config,
    reference_logits,
    reference_model,
    rel_err,
    token_ids,
    write_release,
)
from sglang.test.kimi_k3_reference import ATOL, RTOL
from sglang.test.kimi_k3_reference import reference_logits as k3_reference_logits
from sglang.test.kimi_k3_tiny import CONFIG_A as K3_CONFIG
from sglang.test.kimi_k3_tiny import config as k3_config
from sglang.test.kimi_k3_tiny import make_model, tokens
from sglang.test.release_checkpoint import deepseek_v4, kimi_k3
from sglang.test.release_checkpoint.emit import ReleaseCheckpoint
from sglang.test.run import run_this_file

register_cpu_ci(est_time=20)

T = 140  # crosses the window, many ratio-4 blocks and one ratio-128 block
FP32_TOL = 1e-4  # as the DSv4 parity tests: only the summation order differs
SPEC = LayerBuildSpec(dtype=torch.float32, moe_runner="torch")
OPTS = LoadOptions(progress=False)


def _dsv4_check(ckpt: ReleaseCheckpoint, hf: HFDeepseekV4) -> float:
    assert ckpt.values is not None
    hf.load_state_dict(deepseek_v4.to_transformers(ckpt.values))
    model = load_model(ckpt.path, SPEC, OPTS)
    ids = token_ids(T, CONFIG_A["vocab_size"], seed=8)
    return rel_err(model(ids, torch.arange(T)), reference_logits(hf, ids))


def test_dsv4_quantised_from_transformers_matches_transformers(tmp_path: Path) -> None:
    hf = reference_model(CONFIG_A, seed=7)
    before = hf.state_dict()["model.layers.1.self_attn.q_b_proj.weight"].clone()
    ckpt = write_release(tmp_path, CONFIG_A, hf, quantised=True, max_shard_bytes=100_000)
    err = _dsv4_check(ckpt, hf)
    # the reference now holds the checkpoint's FP8 values, not its own fp32 ones
    after = hf.state_dict()["model.layers.1.self_attn.q_b_proj.weight"]
    assert 1e-3 < rel_err(after, before) < 0.1
    print(f"DSv4 release checkpoint vs transformers on its values: rel max err {err:.2e}")
    assert err < FP32_TOL, err


def test_dsv4_random_matches_transformers(tmp_path: Path) -> None:
    ckpt = deepseek_v4.write_random(tmp_path, CONFIG_A, seed=9)
    hf = HFDeepseekV4(hf_config(CONFIG_A)).eval()
    err = _dsv4_check(ckpt, hf)
    print(f"DSv4 random release checkpoint vs transformers: rel max err {err:.2e}")
    assert err < FP32_TOL, err


def _k3_check(ckpt: ReleaseCheckpoint) -> None:
    assert ckpt.values is not None
    model = load_model(ckpt.path, SPEC, OPTS)
    ref = KimiK3ForCausalLM(k3_config(K3_CONFIG), SPEC)
    kimi_k3.into_model(ref, ckpt.values)
    ids = tokens(70, seed=1)  # > one 64-token KDA chunk
    torch.testing.assert_close(
        model(ids, torch.arange(70)), k3_reference_logits(ref, ids), rtol=RTOL, atol=ATOL
    )


def test_k3_quantised_from_our_model_matches_the_reference(tmp_path: Path) -> None:
    src = make_model(K3_CONFIG, seed=5)
    ckpt = kimi_k3.write_from_tensors(
        tmp_path, K3_CONFIG, kimi_k3.from_model(src), max_shard_bytes=100_000
    )
    # MXFP4 moved the experts, bf16 the dense weights: the reference is on the written values
    assert ckpt.values is not None
    name = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight"
    src_w2 = src.decoder_layers[2].mlp.experts.weights.w2[3]  # type: ignore[union-attr]
    assert 1e-3 < rel_err(ckpt.values[name], src_w2) < 0.5
    _k3_check(ckpt)


def test_k3_random_matches_the_reference(tmp_path: Path) -> None:
    _k3_check(kimi_k3.write_random(tmp_path, K3_CONFIG, seed=6, vision=True))


if __name__ == "__main__":
    run_this_file(__file__)
