"""How a launch cuts one length into slices for its programs: whole blocks, shared out evenly.

The split-K kernels cut a length so that more programs run at once: the decode attentions their
key lists (``attention/sparse_decode_attention.py``, ``attention/absorbed_mla_decode.py``), the
mHC mixes the hidden width (``layernorm/mhc_triton.py``, ``layernorm/mhc_mix_mma.py``), the FP8
GEMM its K loop (``gemm/fp8_block_gemm.py``). Each slice is a whole number of blocks (a program
loops over blocks), the blocks are shared out as evenly as they go, and the count is whatever
that leaves: at most the count asked for, never an empty slice."""

from __future__ import annotations

import triton


def split_blocks(length: int, block: int, most: int) -> tuple[int, int]:
    """``length`` (> 0) in at most ``most`` slices of whole ``block``s -> ``(slices, length of a
    slice)``; the last slice may be shorter (it ends at ``length``)."""
    blocks = triton.cdiv(length, block)
    per_slice = triton.cdiv(blocks, max(1, min(most, blocks))) * block
    return triton.cdiv(length, per_slice), per_slice
