"""Loading DeepSeek V4 checkpoints from disk: transformers' ``save_pretrained`` output, the
official release layout written by the test kit (``sglang.test.release_checkpoint``: release
names, shards + index, an MTP layer to skip, FP8 block-scaled dense weights with UE8M0 scales and
MXFP4 or FP8 experts), and clear errors for missing, renamed or mis-shaped tensors."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.checkpoint_index import WeightLoadError
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.loading import load_model, load_weights
from sglang.test.ci_register import register_cpu_ci
from sglang.test.dsv4_tiny import CONFIG_A, our_model, reference_model, rel_err, token_ids
from sglang.test.release_checkpoint import deepseek_v4 as release
from sglang.test.release_checkpoint.layout import Split
from sglang.test.release_checkpoint.shards import save_sharded
from sglang.test.run import run_this_file

register_cpu_ci(est_time=25)

T = 140  # crosses the window, many ratio-4 blocks and one ratio-128 block


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


def _release_state(hf) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The reference model's weights under the official release names (unquantised)."""
    return release.from_transformers(hf.state_dict())


def _load(path: Path) -> DeepseekV4ForCausalLM:
    return load_model(
        path,
        LayerBuildSpec(dtype=torch.float32, moe_runner="torch"),
        LoadOptions(progress=False),
    )


def _from_tensors(
    config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> DeepseekV4ForCausalLM:
    """A model of ``config`` built from plain (dequantised) tensors: the release's FP8
    ``quantization_config`` is dropped, since these tensors are not FP8."""
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict(plain),
        LayerBuildSpec(dtype=torch.float32, moe_runner="torch"),
    )
    load_weights(model, tensors, LoadOptions(progress=False))
    return model


def test_save_pretrained_dir_loads_to_the_same_logits(
    saved_dir: Path, expected: torch.Tensor
) -> None:
    assert torch.equal(_logits(_load(saved_dir)), expected)


def test_release_naming_with_mtp_and_shards(
    hf,
    expected: torch.Tensor,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    # Unquantised, in the reference's own dtype (fp32): the reload is exact.
    ckpt = release.write_from_tensors(
        tmp_path / "release",
        CONFIG_A,
        _release_state(hf),
        dense="bf16",
        experts="bf16",
        plain_dtype=None,
        max_shard_bytes=60_000,
    )
    names = ckpt.layout.entries
    assert "layers.0.attn.kv_norm.weight" in names and "embed.weight" in names
    assert "hc_head_fn" in names and len(list(ckpt.path.glob("model-*.safetensors"))) > 1
    mtp = [n for n, e in names.items() if e.split is Split.NOT_LOADED]
    assert mtp and all(n.startswith("mtp.0.") for n in mtp)
    monkeypatch.setattr(logging.getLogger("sglang"), "propagate", True)  # caplog hooks the root
    with caplog.at_level(logging.INFO, logger="sglang"):
        model = _load(ckpt.path)
    assert any(f"skipping {len(mtp)} MTP tensors" in r.getMessage() for r in caplog.records)
    assert torch.equal(_logits(model), expected)


def test_fp8_dense_and_mxfp4_experts(hf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ckpt = release.write_from_tensors(tmp_path / "q", CONFIG_A, _release_state(hf))
    entries = ckpt.layout.entries
    assert entries["layers.1.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert entries["layers.1.attn.wq_b.scale"].dtype == torch.float8_e8m0fnu
    assert entries["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert ckpt.values is not None
    # Both formats dequantise exactly, so the model equals one built from the dequantised values.
    assert torch.equal(_logits(_load(ckpt.path)), _logits(_from_tensors(ckpt.config, ckpt.values)))


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
    ckpt = release.write_from_tensors(tmp_path / "q8", config, _release_state(hf), experts="fp8")
    dequant = ckpt.values
    assert dequant is not None
    assert ckpt.layout.entries["layers.1.ffn.experts.0.w1.weight"].dtype == torch.float8_e4m3fn
    model = _load(ckpt.path)
    w = model.layers[1].ffn.experts.weights
    assert w is not None and w.is_fp8
    # Weights and scales land exactly: gate rows then up rows, per expert.
    w13, w2 = w.dequantized(torch.float32)
    for e in range(4):
        p = f"layers.1.ffn.experts.{e}"
        want13 = torch.cat([dequant[f"{p}.w1.weight"], dequant[f"{p}.w3.weight"]])
        assert torch.equal(w13[e], want13) and torch.equal(w2[e], dequant[f"{p}.w2.weight"])
    # The FP8 runner also quantises activations (e4m3, per 128 values): a few % of error.
    err = rel_err(_logits(model), _logits(_from_tensors(ckpt.config, dequant)))
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
def test_bad_checkpoints_name_the_tensor(hf, tmp_path: Path, edit: str, message: str) -> None:  # type: ignore[no-untyped-def]
    tensors = dict(
        release.release_tensors(
            CONFIG_A, _release_state(hf), dense="bf16", experts="bf16", plain_dtype=None
        ).tensors
    )
    op, name = edit.split(":")
    if op == "drop":
        del tensors[name]
    elif op == "rename":
        tensors[name.replace("wkv", "wkv_typo")] = tensors.pop(name)
    elif op == "transpose":
        tensors[name] = tensors[name].t().contiguous()
    else:
        tensors[name] = torch.zeros(2)
    save_sharded(tmp_path / "bad", tensors, release.release_config(CONFIG_A, dense="bf16"))
    with pytest.raises(WeightLoadError, match=message):
        _load(tmp_path / "bad")


if __name__ == "__main__":
    run_this_file(__file__)
