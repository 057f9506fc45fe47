"""The built-in default model: generated deterministically (same files twice), a real DeepSeek V4
checkpoint directory (hash routing, ratios 0/4/128) that the loader takes, vocabulary equal to the
tokenizer's, and a working forward."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from sglang.srt.default_model.generate import ensure_default_model
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.managers.tokenizer import load_tokenizer
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.loading import load_model
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=10)


def _digest(path: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_generated_deterministically(tmp_path: Path) -> None:
    a = ensure_default_model(tmp_path / "a")
    b = ensure_default_model(tmp_path / "b")
    assert os.path.basename(a) == os.path.basename(b)
    assert _digest(a) == _digest(b)
    assert ensure_default_model(tmp_path / "a") == a  # reused, not regenerated


def test_checkpoint_and_tokenizer(tmp_path: Path) -> None:
    path = ensure_default_model(tmp_path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["model_type"] == "deepseek_v4"
    assert set(config["compress_ratios"]) == {0, 4, 128} and config["num_hash_layers"] >= 1
    tok = load_tokenizer(path)
    assert tok.vocab_size == config["vocab_size"]
    assert tok.eos_token_id == config["eos_token_id"] and not tok.has_own_chat_template
    for marker in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜"):
        assert tok.token_id(marker) is not None, marker  # DeepSeek V4's chat encoding needs them
    model = load_model(
        path, LayerBuildSpec(dtype=torch.float32, moe_runner="torch"), LoadOptions(progress=False)
    )
    ids = torch.tensor(tok.encode("The quick brown fox " * 40))  # > 128 tokens: a ratio-128 entry
    logits = model(ids, torch.arange(ids.shape[0]))
    assert logits.shape == (ids.shape[0], config["vocab_size"])
    assert torch.isfinite(logits).all() and logits.std() > 0.1


if __name__ == "__main__":
    run_this_file(__file__)
