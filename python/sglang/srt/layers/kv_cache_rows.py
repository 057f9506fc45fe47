"""FP8 cache rows (``--kv-cache-dtype fp8_e4m3``): the :class:`~sglang.srt.mem_cache.row_codec.
RowCodec` of rows in the packed FP8 layout of ``kernels/ops/quant/fp8_rows.py``, which the
attention layers build their caches with and hand the kernels (:func:`fp8_format`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.ops.quant.fp8_row_write import write_fp8_rows
from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat
from sglang.kernels.ops.triton_dispatch import triton_can_run
from sglang.srt.mem_cache.row_codec import PlainRows, RowCodec


@dataclass(frozen=True)
class Fp8Rows:
    """Rows of ``fmt.dim`` values for a model computing in ``dtype``, stored as FP8 rows of
    ``fmt.row_bytes`` bytes (uint8); decoded exactly into fp32 and bf16."""

    fmt: Fp8RowFormat
    dtype: torch.dtype

    @property
    def dim(self) -> int:
        return self.fmt.dim

    @property
    def store_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def width(self) -> int:
        return self.fmt.row_bytes

    @property
    def row_bytes(self) -> int:
        return self.fmt.row_bytes

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        return self.fmt.quantize(values)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.fmt.dequantize(rows, dtype or self.dtype)

    def write(self, store: torch.Tensor, dest: torch.Tensor, values: torch.Tensor) -> None:
        """Quantised and scattered in one kernel where Triton runs (``write_fp8_rows``: the
        cache write of rows made outside a kernel of their own), else by torch (off CUDA, or
        with the fp8_rows kernels turned off after a build failure)."""
        if triton_can_run(store) and unfit_reason("fp8_rows") is None:
            write_fp8_rows(values.contiguous(), store, dest, self.fmt)
            return
        store.view(-1, self.fmt.row_bytes).index_copy_(0, dest, self.encode(values))

    def describe(self) -> str:
        return f"FP8 {self.fmt.describe()}"


def row_codec(dim: int, dtype: torch.dtype, *, fp8: bool, rope: int = 0) -> RowCodec:
    """Rows of ``dim`` values: FP8 (the last ``rope`` kept bf16) or the model dtype."""
    if fp8:
        return Fp8Rows(Fp8RowFormat(dim, rope), dtype)
    return PlainRows(dim, dtype)


def fp8_format(codec: RowCodec | None) -> Fp8RowFormat | None:
    """The FP8 layout the kernels read and write rows of ``codec`` in (None: plain values)."""
    return codec.fmt if isinstance(codec, Fp8Rows) else None
