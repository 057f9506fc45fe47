"""Sharded safetensors as the releases lay them out: ``model-0000i-of-0000n.safetensors`` files of
at most ``max_shard_bytes`` each, filled in write order, and ``model.safetensors.index.json``
(``metadata.total_size`` and the ``weight_map`` of every tensor to its file).

Tensors are handed over one at a time and a shard is written as soon as it is full, so a
real-width checkpoint never sits in host memory whole. The number of shards is known only at the
end, so shards are written under a temporary name and renamed by :meth:`close`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # transformers' default shard size ("5GB")


class ShardedSafetensorsWriter:
    def __init__(self, path: str | os.PathLike[str], max_shard_bytes: int) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names of each written shard
        self._total = 0
        self._names: set[str] = set()

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one CPU tensor (owning its storage); a full shard is written first."""
        if name in self._names:
            raise ValueError(f"tensor {name!r} written twice")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r} must be a contiguous CPU tensor")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor
        self._names.add(name)
        self._pending_bytes += nbytes
        self._total += nbytes

    def _temp_name(self, index: int) -> Path:
        return self.path / f".model-{index + 1:05d}.safetensors.partial"

    def _flush(self) -> None:
        index = len(self._shards)
        save_file(self._pending, str(self._temp_name(index)), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Write the last shard, name the shards ``-of-n`` and write the index; returns its
        weight map."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self._shards):
            file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self._temp_name(i), self.path / file)
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
        (self.path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return weight_map


def save_sharded(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write ``tensors`` exactly as given (already in file form, e.g. an edited copy of a
    release's tensors) as shards + index, with ``config.json``."""
    writer = ShardedSafetensorsWriter(path, max_shard_bytes)
    for name, t in tensors.items():
        writer.put(name, t.detach().to("cpu", copy=True).contiguous())
    writer.close()
    (Path(path) / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
