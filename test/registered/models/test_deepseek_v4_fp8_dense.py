"""A tiny DeepSeek V4 checkpoint in the release format with FP8 dense weights (e4m3, UE8M0 scales
per 128x128 tile, ``quantization_config`` fp8): loaded in bf16 its FP8 layers stay FP8 (exactly
the release's set) and run W8A8, its logits close to the fp32 model of the dequantised weights;
loaded in fp32 it dequantises at load and equals that model exactly (and transformers within the
fp32 parity tolerance). The fused activation quantisers give the same logits, and the static
decode over the slot pool equals the eager decode.

Dims are 128-multiples where the FP8 GEMMs take their K (hidden, q_lora, o_lora, the grouped
wo_a's 128 inputs a group, the shared expert's width), as in the release; every expert is routed
and the indexer keeps every entry, so activation rounding cannot flip a discrete choice."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.linear import GroupedColumnParallelLinear, LinearBase
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.loading import load_weights
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import CONFIG_A, reference_logits, reference_model, rel_err, token_ids
from sglang.test.pooled_decode_checks import prefill_eager_and_pooled, worst_pooled_vs_eager
from sglang.test.release_checkpoint import deepseek_v4 as release_kit
from sglang.test.run import run_this_file

register_cpu_ci(est_time=30)

T = 140  # crosses the window, many ratio-4 blocks and one ratio-128 block
WIDE = {
    "hidden_size": 128,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "head_dim": 64,  # 4 heads x 64 over 2 groups: wo_a takes 128 inputs a group
    "moe_intermediate_size": 128,
    "num_experts_per_tok": CONFIG_A["n_routed_experts"],
    "index_topk": 4096,
}
# The release's FP8 dense layers (the loading test quantises exactly these).
FP8_LAYERS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "indexer.wq_b", "shared_experts.w")


@pytest.fixture(scope="module")
def release():  # type: ignore[no-untyped-def]
    """(hf model, quantised release tensors, their dequantised values, release config)."""
    config = dict(CONFIG_A, **WIDE)
    hf = reference_model(config, seed=5)
    # Plain tensors kept fp32, so the fp32 model on the dequantised values is the reference's.
    rel = release_kit.release_tensors(
        config, release_kit.from_transformers(hf.state_dict()), experts="bf16", plain_dtype=None
    )
    return hf, dict(rel.tensors), dict(rel.values), release_kit.release_config(config, mtp=False)


def _model(config: dict, tensors: dict, dtype: torch.dtype) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict(config), LayerBuildSpec(dtype=dtype, moe_runner="torch")
    )
    load_weights(model, tensors, LoadOptions(progress=False))
    return model.eval()


def _unquantised(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "quantization_config"}


@pytest.fixture(scope="module")
def w8a8(release) -> DeepseekV4ForCausalLM:  # type: ignore[no-untyped-def]
    _, quant, _, config = release
    return _model(config, quant, torch.bfloat16)


@pytest.fixture(scope="module")
def fp32_dequantised(release) -> DeepseekV4ForCausalLM:  # type: ignore[no-untyped-def]
    _, _, dequant, config = release
    return _model(_unquantised(config), dequant, torch.float32)


def _logits(model: DeepseekV4ForCausalLM) -> torch.Tensor:
    return model(token_ids(T, CONFIG_A["vocab_size"], seed=3), torch.arange(T))


def test_exactly_the_release_fp8_layers_stay_fp8(release, w8a8) -> None:  # type: ignore[no-untyped-def]
    _, quant, _, _ = release
    fp8 = {n for n, m in w8a8.named_modules() if isinstance(m, LinearBase) and m.fp8}
    linears = {n for n, m in w8a8.named_modules() if isinstance(m, LinearBase)}
    want = {n for n in linears if any(f".{p}" in n for p in FP8_LAYERS) and "compressor" not in n}
    assert fp8 == want and len(fp8) == 3 * 5 + 1 + 3 * 3  # 5 a layer, 1 indexer, 3 shared
    assert {n for n in linears - fp8 if "compressor" in n or "weights_proj" in n or n == "head"}
    for name in fp8:
        layer = w8a8.get_submodule(name)
        ckpt = quant[f"{name}.weight"]
        assert torch.equal(layer.weight.view(torch.uint8), ckpt.view(torch.uint8))
        assert torch.equal(layer.weight_scale_inv, quant[f"{name}.scale"].float())
        resident = layer.weight.nbytes + layer.weight_scale_inv.nbytes
        assert resident == ckpt.numel() + 4 * quant[f"{name}.scale"].numel()
    for name in linears - fp8:
        assert w8a8.get_submodule(name).weight.dtype == torch.bfloat16


def test_w8a8_logits_close_to_the_fp32_dequantised_model(w8a8, fp32_dequantised) -> None:  # type: ignore[no-untyped-def]
    want = _logits(fp32_dequantised)
    got = _logits(w8a8)
    err, mean = rel_err(got, want), float((got - want).abs().mean() / want.abs().mean())
    print(f"W8A8 vs fp32: rel max {err:.3e}, mean {mean:.3e} (bf16 weights alone: ~2e-2)")
    # e4m3 activations (3 mantissa bits, ~2.6% per GEMM) through 3 layers of ~8 GEMMs each
    assert err < 0.3 and mean < 0.25
    # and each FP8 layer on its own: within e4m3's rounding of the dequantised product
    gen = torch.Generator().manual_seed(1)
    for name, layer in w8a8.named_modules():
        if not (isinstance(layer, LinearBase) and layer.fp8):
            continue
        grouped = isinstance(layer, GroupedColumnParallelLinear)
        shape = (16, layer.local_groups, layer.in_local) if grouped else (16, layer.in_local)
        inp = torch.randn(shape, generator=gen).bfloat16()
        ref = fp32_dequantised.get_submodule(name)(inp.float())
        e = float((layer(inp).float() - ref).norm() / ref.norm())
        assert 1e-3 < e < 0.05, (name, e)


def test_fp32_run_dequantises_and_equals_transformers(release, fp32_dequantised) -> None:  # type: ignore[no-untyped-def]
    hf, quant, _, config = release
    ours = _model(config, quant, torch.float32)
    assert all(not m.fp8 for m in ours.modules() if isinstance(m, LinearBase))
    assert torch.equal(_logits(ours), _logits(fp32_dequantised))
    # transformers on the same (dequantised) values
    ids = token_ids(T, CONFIG_A["vocab_size"], seed=3)
    err = rel_err(_logits(ours), reference_logits(_hf_with(hf, fp32_dequantised), ids))
    print(f"fp32 (FP8 checkpoint) vs transformers: rel max {err:.2e}")
    assert err < 1e-4


def _hf_with(hf, ours: DeepseekV4ForCausalLM):  # type: ignore[no-untyped-def]
    """``hf`` with each dense weight replaced by ours (the dequantised values)."""
    import copy

    from sglang.srt.models.deepseek_v4_checkpoint import canonical_name

    out = copy.deepcopy(hf)
    params = dict(ours.named_parameters())
    changed = 0
    with torch.no_grad():
        for name, p in out.named_parameters():
            mine = params.get(canonical_name(name) or "")
            if mine is not None and mine.shape == p.shape and not torch.equal(mine, p.float()):
                p.copy_(mine)
                changed += 1
    assert changed == 3 * 5 + 1 + 3 * 3  # exactly the FP8 layers' weights moved
    return out


def test_fused_activation_quantisers_give_the_same_logits(release, w8a8) -> None:  # type: ignore[no-untyped-def]
    _, quant, _, config = release
    with envs.SGLANG_FP8_FUSED_ACT_QUANT.override(True):
        fused = _model(config, quant, torch.bfloat16)
    attn = fused.layers[1].attn
    assert attn.fuse_q_norm_quant and attn.fuse_wo_a_quant
    assert fused.layers[1].ffn.shared_experts.fuse_act_quant
    assert torch.equal(_logits(fused), _logits(w8a8))


def test_static_decode_equals_eager_with_fp8_layers(w8a8) -> None:  # type: ignore[no-untyped-def]
    w8a8.enable_slot_pool(max_slots=2, capacity=64)
    lengths, steps = (5, 9), 3
    seqs = [token_ids(n + steps, CONFIG_A["vocab_size"], seed=40 + n) for n in lengths]
    eager, pooled = prefill_eager_and_pooled(w8a8, seqs, lengths)
    worst = worst_pooled_vs_eager(w8a8, seqs, lengths, steps, eager, pooled, pad_to=3)
    assert worst < 2e-2, worst
    for p in pooled:
        w8a8.free_pooled_cache(p)


if __name__ == "__main__":
    run_this_file(__file__)
