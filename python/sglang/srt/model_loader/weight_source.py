"""Where checkpoint tensors come from: a directory of safetensors shards, or an in-memory dict.

Tensors are read by name on demand, so the loader can pair a weight with its scale wherever the
shards put them, and report exactly which names are missing or left over.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11


class WeightSource(Protocol):
    def names(self) -> list[str]: ...

    def get(self, name: str) -> torch.Tensor: ...


class DictWeightSource:
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = dict(tensors)

    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]


class SafetensorsWeightSource:
    """All ``*.safetensors`` files of ``model_dir`` (through ``model.safetensors.index.json`` when
    present, which also says which file holds which tensor)."""

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        self.model_dir = os.fspath(model_dir)
        index = os.path.join(self.model_dir, "model.safetensors.index.json")
        self._file_of: dict[str, str] = {}
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            for name, file in weight_map.items():
                self._file_of[name] = os.path.join(self.model_dir, file)
        else:
            files = sorted(glob.glob(os.path.join(self.model_dir, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.model_dir}")
            for path in files:
                with safe_open(path, framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                        if name in self._file_of:
                            raise ValueError(
                                f"tensor {name!r} appears in both {self._file_of[name]} and {path}"
                            )
                        self._file_of[name] = path
        self._handles: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        path = self._file_of[name]
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(path, framework="pt", device="cpu")
        return handle.get_tensor(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def as_weight_source(source: WeightSource | Mapping[str, torch.Tensor]) -> WeightSource:
    """A name -> tensor mapping (e.g. a ``state_dict()``) becomes a :class:`DictWeightSource`."""
    return DictWeightSource(source) if isinstance(source, Mapping) else source
