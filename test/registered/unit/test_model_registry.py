"""The model registry: every model file registers one entry (found without a central list), a
config.json dict finds its entry by architecture or model type, an unknown one is refused naming
what is served, an entry builds its model from the config dict the caller read once, and its
abilities are the Protocols it implements."""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang.srt.default_model.generate import ensure_default_model
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_executor.model_abilities import abilities_of
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.config_common import read_config_json
from sglang.srt.models.loading import load_model
from sglang.srt.models.registry import (
    UnsupportedModelError,
    entry_of,
    find_model,
    model_entries,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=6)

SPEC = LayerBuildSpec(dtype=torch.float32, moe_runner="torch")


def test_every_model_file_registers_itself() -> None:
    entries = {e.architecture: e for e in model_entries()}
    assert set(entries) == {"DeepseekV4ForCausalLM", "KimiK3ForCausalLM"}
    assert entries["KimiK3ForCausalLM"].model_types == ("kimi_k3", "kimi_linear")
    for entry in entries.values():
        assert entry.model_class.__name__ == entry.architecture
        assert entry.batch_class.__module__ == entry.model_class.__module__


def test_found_by_architecture_or_model_type_and_refused_by_name() -> None:
    assert find_model({"architectures": ["KimiK3ForCausalLM"]}).architecture == "KimiK3ForCausalLM"
    assert find_model({"model_type": "kimi_linear"}).architecture == "KimiK3ForCausalLM"
    assert find_model({"model_type": "deepseek_v4"}).architecture == "DeepseekV4ForCausalLM"
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*serves Deepseek"):
        find_model({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_config_json_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller reads config.json once and hands the dict down: the load opens it no more."""
    path = ensure_default_model(tmp_path)
    raw = read_config_json(path)
    opened: list[str] = []
    real_open = builtins.open

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if os.path.basename(str(file)) == "config.json":
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    model = load_model(path, SPEC, LoadOptions(progress=False), config=raw)
    assert opened == []
    assert entry_of(model).architecture == raw["architectures"][0]
    # what the model declares beyond the batch API (DeepSeek V4: no gate on its static decode)
    assert abilities_of(model) == [
        "SupportsSlotPool",
        "SupportsStaticDecode",
        "SupportsMemoryModel",
        "SupportsKVCacheDtype",
    ]


if __name__ == "__main__":
    run_this_file(__file__)
