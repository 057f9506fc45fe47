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


# safetensors header dtype names -> torch dtypes (the ones checkpoints of these models use).
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


class WeightSource(Protocol):
    def names(self) -> list[str]: ...

    def get(self, name: str) -> torch.Tensor: ...

    def dtype_of(self, name: str) -> torch.dtype:
        """The stored dtype, without reading the tensor."""
        ...


class DictWeightSource:
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = dict(tensors)

    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def dtype_of(self, name: str) -> torch.dtype:
        return self._tensors[name].dtype


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

    def dtype_of(self, name: str) -> torch.dtype:
        """Read from the file's header: the tensor itself is not loaded."""
        path = self._file_of[name]
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(path, framework="pt", device="cpu")
        stored = handle.get_slice(name).get_dtype()
        if stored not in _SAFETENSORS_DTYPES:
            return handle.get_tensor(name).dtype  # a dtype this table does not name: read it
        return _SAFETENSORS_DTYPES[stored]

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def as_weight_source(source: WeightSource | Mapping[str, torch.Tensor]) -> WeightSource:
    """A name -> tensor mapping (e.g. a ``state_dict()``) becomes a :class:`DictWeightSource`."""
    return DictWeightSource(source) if isinstance(source, Mapping) else source
