"""Quantise rows into an FP8 row store and scatter them in one launch (``fp8_rows.py``'s layout):
the cache write of rows computed outside a kernel of their own, such as Kimi K3's MLA latents.

Row ``i`` of ``values [T, dim]`` (any float dtype) becomes the FP8 row ``dest[i]`` of the store
(uint8, ``row_bytes`` per row, rows contiguous; ``dest`` flat row indices, int64 on the device):
one program a row computes its group exponents, writes the e4m3 codes, the bf16 tail and the
scales. Shapes are fixed by ``T`` and the indices are read on the device (CUDA-graph safe). The
bytes equal :meth:`Fp8RowFormat.quantize`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.quant.fp8_rows import (
    Fp8RowFormat,
    group_exponent,
    group_exponents,
    store_row,
    store_scales,
)


@triton.jit
def _write_kernel(
    x_ptr, x_stride, dest_ptr, store_ptr, row_bytes,
    DIM: tl.constexpr, DIM_P2: tl.constexpr, F: tl.constexpr, ROPE: tl.constexpr,
    ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, G: tl.constexpr, NG: tl.constexpr,
    NUM_SCALES: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, DIM_P2)
    v = tl.load(x_ptr + i * x_stride + col, mask=col < DIM, other=0.0).to(tl.float32)
    k = group_exponent(group_exponents(v, col, F, G, NG))
    row = store_ptr + tl.load(dest_ptr + i) * row_bytes
    store_row(row, v, col, k, F, ROPE, ROPE_OFF, G, NG)
    store_scales(row, k, SCALE_OFF, NG, NUM_SCALES)


def write_fp8_rows(
    values: torch.Tensor, store: torch.Tensor, dest: torch.Tensor, fmt: Fp8RowFormat
) -> None:
    """Quantise ``values [T, dim]`` into rows ``dest [T]`` (int64, distinct) of ``store`` (uint8
    ``[..., row_bytes]``, contiguous rows)."""
    t = values.shape[0]
    if values.dim() != 2 or values.shape[1] != fmt.dim or values.stride(1) != 1:
        raise ValueError(f"values must be [T, {fmt.dim}] with contiguous rows, got {values.shape}")
    if store.dtype != torch.uint8 or store.shape[-1] != fmt.row_bytes or not store.is_contiguous():
        raise ValueError(
            f"the store must hold contiguous uint8 rows of {fmt.row_bytes} bytes, got "
            f"{store.dtype} {tuple(store.shape)}"
        )
    if dest.shape != (t,) or dest.dtype != torch.int64:
        raise ValueError(f"dest must be int64 [{t}], got {dest.dtype} {tuple(dest.shape)}")
    if t == 0:
        return
    _write_kernel[(t,)](
        values, values.stride(0), dest, store, fmt.row_bytes,
        DIM=fmt.dim, DIM_P2=triton.next_power_of_2(fmt.dim), F=fmt.fp8_dims, ROPE=fmt.rope,
        ROPE_OFF=fmt.rope_offset, SCALE_OFF=fmt.scale_offset, G=fmt.group,
        NG=triton.next_power_of_2(fmt.num_scales), NUM_SCALES=fmt.num_scales, num_warps=4,
    )  # fmt: skip
