"""Loading DeepSeek V4 checkpoints from disk: transformers' ``save_pretrained`` output, the
official release naming (with FP8 block-scaled dense weights and MXFP4 or FP8 experts, and MTP
tensors to skip), and clear errors for missing, renamed or mis-shaped tensors."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dsv4_testing import CONFIG_A, our_model, reference_model, rel_err, token_ids

from sglang.kernels.ops.quant.fp8 import block_dequant_fp8
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.quantization.mxfp4 import dequant_mxfp4, quant_mxfp4
from sglang.srt.model_loader.deepseek_v4_loader import (
    WeightLoadError,
    load_deepseek_v4,
    load_weights,
)
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=25)

T = 140  # crosses the window, many ratio-4 blocks and one ratio-128 block
# Dense weights the release ships as FP8 128x128 blocks (see the design notes).
_FP8_SUFFIXES = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "attn.indexer.wq_b.weight",
    "shared_experts.w1.weight",
    "shared_experts.w2.weight",
    "shared_experts.w3.weight",
)


@pytest.fixture(scope="module")
def hf():  # type: ignore[no-untyped-def]
    return reference_model(CONFIG_A, seed=5)


@pytest.fixture(scope="module")
def saved_dir(hf, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("dsv4_hf")
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def expected(hf) -> torch.Tensor:  # type: ignore[no-untyped-def]
    ids = token_ids(T, CONFIG_A["vocab_size"], seed=3)
    return our_model(hf)(ids, torch.arange(T))


def _logits(model: DeepseekV4ForCausalLM) -> torch.Tensor:
    return model(token_ids(T, CONFIG_A["vocab_size"], seed=3), torch.arange(T))


def _release_tensors(saved_dir: Path) -> dict[str, torch.Tensor]:
    """save_pretrained's tensors under the official release names."""
    from safetensors.torch import load_file

    out = {}
    for name, t in load_file(saved_dir / "model.safetensors").items():
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
        name = name.replace("hc_head.hc_", "hc_head_").replace(".attn.norm.", ".attn.kv_norm.")
        out[name] = t.contiguous()
    return out


# What the release's config.json says of its FP8 dense weights.
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}


def _release_config(hf, quantized: bool = False) -> dict:  # type: ignore[no-untyped-def]
    """config.json the way the release writes it (per-layer ratios incl. one for the MTP layer;
    ``quantized``: its FP8 ``quantization_config``)."""
    raw = {k: v for k, v in CONFIG_A.items()}
    if quantized:
        raw["quantization_config"] = FP8_QUANTIZATION_CONFIG
    raw.update(
        model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], num_key_value_heads=1
    )
    raw["compress_ratios"] = list(CONFIG_A["compress_ratios"]) + [0]
    raw["num_nextn_predict_layers"] = 1
    return raw


def _write(path: Path, tensors: dict[str, torch.Tensor], config: dict, shards: int = 2) -> None:
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, path / file)
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (path / "config.json").write_text(json.dumps(config))


def _ue8m0_block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight + one power-of-two (float8_e8m0fnu) scale per 128x128 tile, like the release."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(nb * 128, kb * 128)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, 128, kb, 128)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (tiles / scale[:, None, :, None]).view(nb * 128, kb * 128)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.to(torch.float8_e8m0fnu)


def _quantised_release(tensors: dict[str, torch.Tensor], experts: str) -> tuple[dict, dict]:
    """(quantised release tensors, the dequantised values the model should end up with)."""
    quant, dequant = {}, {}
    for name, t in tensors.items():
        if name.endswith(_FP8_SUFFIXES):
            q, s = _ue8m0_block_fp8(t)
            quant[name], quant[name.removesuffix(".weight") + ".scale"] = q, s
            dequant[name] = block_dequant_fp8(q, s.float())
        elif ".experts." in name and experts == "mxfp4":
            q, s = quant_mxfp4(t)
            quant[name], quant[name.removesuffix(".weight") + ".scale"] = (
                q,
                s.view(torch.float8_e8m0fnu),
            )
            dequant[name] = dequant_mxfp4(q, s, torch.float32)
        elif ".experts." in name and experts == "fp8":
            q, s = _ue8m0_block_fp8(t)
            quant[name], quant[name.removesuffix(".weight") + ".scale"] = q, s
            dequant[name] = block_dequant_fp8(q, s.float())
        else:
            quant[name] = dequant[name] = t
    return quant, dequant


def _from_tensors(config: dict, tensors: dict[str, torch.Tensor]) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict(config),
        LayerBuildSpec(dtype=torch.float32, moe_runner="torch"),
    )
    load_weights(model, tensors, LoadOptions(progress=False))
    return model


def test_save_pretrained_dir_loads_to_the_same_logits(
    saved_dir: Path, expected: torch.Tensor
) -> None:
    model = load_deepseek_v4(
        saved_dir,
        LayerBuildSpec(dtype=torch.float32, moe_runner="torch"),
        LoadOptions(progress=False),
    )
    assert torch.equal(_logits(model), expected)


def test_release_naming_with_mtp_and_shards(
    hf,
    saved_dir: Path,
    expected: torch.Tensor,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    tensors = _release_tensors(saved_dir)
    assert (
        "layers.0.attn.kv_norm.weight" in tensors
        and "embed.weight" in tensors
        and "hc_head_fn" in tensors
    )
    tensors["mtp.0.e_proj.weight"] = torch.zeros(4, 4)
    tensors["mtp.0.attn.wq_a.weight"] = torch.zeros(4, 4)
    _write(tmp_path / "release", tensors, _release_config(hf))
    monkeypatch.setattr(logging.getLogger("sglang"), "propagate", True)  # caplog hooks the root
    with caplog.at_level(logging.INFO, logger="sglang"):
        model = load_deepseek_v4(
            tmp_path / "release",
            LayerBuildSpec(dtype=torch.float32, moe_runner="torch"),
            LoadOptions(progress=False),
        )
    assert any("skipping 2 MTP tensors" in r.getMessage() for r in caplog.records)
    assert torch.equal(_logits(model), expected)


def test_fp8_dense_and_mxfp4_experts(hf, saved_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    quant, dequant = _quantised_release(_release_tensors(saved_dir), experts="mxfp4")
    assert quant["layers.1.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert quant["layers.1.ffn.experts.0.w1.weight"].dtype == torch.uint8
    _write(tmp_path / "q", quant, _release_config(hf, quantized=True))
    model = load_deepseek_v4(
        tmp_path / "q",
        LayerBuildSpec(dtype=torch.float32, moe_runner="torch"),
        LoadOptions(progress=False),
    )
    # Both formats dequantise exactly, so the model equals one built from the dequantised values.
    # fp32: the FP8 dense weights are dequantised at load, so the maths is the dequantised one.
    assert torch.equal(_logits(model), _logits(_from_tensors(_release_config(hf), dequant)))


def test_fp8_experts_stay_fp8(tmp_path: Path) -> None:
    # FP8 experts: gate and up stack on rows and activations quantise per 128, so I and H are
    # whole 128-blocks.
    # All experts chosen and no indexer pruning: the runner's activation rounding cannot flip a
    # discrete choice, so the logits stay close.
    wide = {
        "moe_intermediate_size": 128,
        "hidden_size": 128,
        "num_experts_per_tok": 4,
        "index_topk": 4096,
    }
    config = dict(CONFIG_A, **wide)
    hf = reference_model(config, seed=6)
    hf.save_pretrained(tmp_path / "hf")
    quant, dequant = _quantised_release(_release_tensors(tmp_path / "hf"), experts="fp8")
    release_config = dict(_release_config(hf, quantized=True), **wide)
    _write(tmp_path / "q8", quant, release_config, shards=1)
    model = load_deepseek_v4(
        tmp_path / "q8",
        LayerBuildSpec(dtype=torch.float32, moe_runner="torch"),
        LoadOptions(progress=False),
    )
    w = model.layers[1].ffn.experts.weights
    assert w is not None and w.is_fp8
    # Weights and scales land exactly: gate rows then up rows, per expert.
    w13, w2 = w.dequantized(torch.float32)
    for e in range(4):
        p = f"layers.1.ffn.experts.{e}"
        want13 = torch.cat([dequant[f"{p}.w1.weight"], dequant[f"{p}.w3.weight"]])
        assert torch.equal(w13[e], want13) and torch.equal(w2[e], dequant[f"{p}.w2.weight"])
    # The FP8 runner also quantises activations (e4m3, per 128 values): a few % of error.
    reference = dict(release_config)
    del reference["quantization_config"]  # the dequantised values as float tensors
    err = rel_err(_logits(model), _logits(_from_tensors(reference, dequant)))
    print(f"FP8 experts vs dequantised: rel max err {err:.2e}")
    assert err < 0.1, err


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("drop:layers.1.attn.indexer.wq_b.weight", "layers.1.attn.indexer.wq_b.weight"),
        ("rename:layers.0.attn.wkv.weight", "layers.0.attn.wkv.weight"),
        ("drop:layers.2.ffn.experts.3.w2.weight", "layers.2.ffn.experts.3.w2.weight"),
        (
            "transpose:layers.1.ffn.experts.1.w3.weight",
            r"layers.1.ffn.experts.1.w3.weight.*expected shape \(32, 64\)",
        ),
        (
            "transpose:layers.2.attn.wo_b.weight",
            r"layers.2.attn.wo_b.weight.*expected shape \(64, 16\), got \(16, 64\)",
        ),
        ("extra:layers.0.attn.not_a_tensor", "layers.0.attn.not_a_tensor"),
    ],
)
def test_bad_checkpoints_name_the_tensor(
    hf, saved_dir: Path, tmp_path: Path, edit: str, message: str
) -> None:  # type: ignore[no-untyped-def]
    tensors = _release_tensors(saved_dir)
    op, name = edit.split(":")
    if op == "drop":
        del tensors[name]
    elif op == "rename":
        tensors[name.replace("wkv", "wkv_typo")] = tensors.pop(name)
    elif op == "transpose":
        tensors[name] = tensors[name].t().contiguous()
    else:
        tensors[name] = torch.zeros(2)
    _write(tmp_path / "bad", tensors, _release_config(hf), shards=1)
    with pytest.raises(WeightLoadError, match=message):
        load_deepseek_v4(
            tmp_path / "bad",
            LayerBuildSpec(dtype=torch.float32, moe_runner="torch"),
            LoadOptions(progress=False),
        )


if __name__ == "__main__":
    run_this_file(__file__)
