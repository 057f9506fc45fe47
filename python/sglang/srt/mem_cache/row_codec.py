"""How one kind of cached row is stored (``--kv-cache-dtype``): the :class:`RowCodec` every cache
of growing rows holds (the compressed entries and indexer keys of DeepSeek V4, Kimi K3's MLA
latents), and :class:`PlainRows`, values of the model dtype. FP8 rows are the layers' codec
(``layers/kv_cache_rows.py``: they quantise with the kernels this package sits below); the caches
only store what a codec encodes and hand its rows back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class RowCodec(Protocol):
    """``dim`` values a row for a model computing in ``dtype``, stored as ``width`` columns of
    ``store_dtype`` (``row_bytes`` bytes)."""

    @property
    def dim(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def store_dtype(self) -> torch.dtype: ...

    @property
    def width(self) -> int: ...

    @property
    def row_bytes(self) -> int: ...

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """``values [..., dim]`` -> stored rows ``[..., width]``."""
        ...

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored rows -> values in ``dtype`` (default: the model dtype)."""
        ...

    def write(self, store: torch.Tensor, dest: torch.Tensor, values: torch.Tensor) -> None:
        """``values [m, dim]`` into rows ``dest [m]`` (int64, on the store's device) of ``store
        [N, width]`` (a flat view of a row store), with no host sync (CUDA-graph safe)."""
        ...

    def describe(self) -> str:
        """``<how> = <row_bytes> B`` for the startup log."""
        ...


@dataclass(frozen=True)
class PlainRows:
    """Rows of ``dim`` values in the model dtype, stored as they are."""

    dim: int
    dtype: torch.dtype

    @property
    def store_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def width(self) -> int:
        return self.dim

    @property
    def row_bytes(self) -> int:
        return self.dim * self.dtype.itemsize

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.dtype)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return rows.to(dtype or self.dtype)

    def write(self, store: torch.Tensor, dest: torch.Tensor, values: torch.Tensor) -> None:
        store.index_copy_(0, dest, self.encode(values))

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} {self.dim} = {self.row_bytes} B"
