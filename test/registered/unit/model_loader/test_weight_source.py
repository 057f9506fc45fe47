"""The safetensors weight source: shards found with and without an index, and a tensor stored in
two shards refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sglang.srt.model_loader.weight_source import SafetensorsWeightSource
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=0.5)


def test_safetensors_source_with_and_without_index(tmp_path: Path) -> None:
    a, b = torch.arange(4.0), torch.ones(2, 3)
    save_file({"a": a}, tmp_path / "part-1.safetensors")
    save_file({"b": b}, tmp_path / "part-2.safetensors")
    source = SafetensorsWeightSource(tmp_path)
    assert sorted(source.names()) == ["a", "b"] and torch.equal(source.get("b"), b)
    index = {"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(SafetensorsWeightSource(tmp_path).get("a"), a)
    save_file({"a": a}, tmp_path / "dup.safetensors")
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="appears in both"):
        SafetensorsWeightSource(tmp_path)


if __name__ == "__main__":
    run_this_file(__file__)
