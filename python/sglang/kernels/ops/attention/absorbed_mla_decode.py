"""Absorbed MLA decode attention over a paged latent store (Kimi K3's NoPE MLA layers): one query
token per request, ``heads`` query heads sharing one latent row per key (MQA in the latent space).

For request ``b`` with ``n = lengths[b]`` live rows, row ``j`` at ``store[table[b, j // R], j % R]``
(``[ckv_j | kpe_j]``, width ``L + P``), and the absorbed queries ``q_lat [bs, heads, L]``,
``q_pe [bs, heads, P]``:
  s_j   = (q_lat . ckv_j + q_pe . kpe_j) * scale
  o_lat = sum_j softmax(s)_j ckv_j                                [bs, heads, L] fp32
(the ``w_vc`` output absorption stays with the caller). A request with no live row gets zeros.
The latents may be FP8 rows (``--kv-cache-dtype fp8_e4m3``: ``quant/fp8_rows.py``, ``ckv`` e4m3,
``kpe`` bf16), dequantised in the key tile into bf16 values: the products below stay exact.

Flash-decoding in three launches with shapes fixed by the batch (CUDA-graph safe: the lengths
and the block table are read from device memory):
- the query split: each fp32 query becomes ``q_parts`` bf16 (fp16) parts, so the products with
  the bf16 latents are exact on the tensor cores (three parts hold all 24 bits; a query already
  in the store's dtype is one part);
- the split kernel: a program takes ``group`` heads of one request over one slice of its keys;
  each key tile is loaded once and used by all of them, for the scores and for the values.
  ``tl.dot`` with bf16 operands and fp32 accumulation; the fp32 probabilities enter the value
  product as ``p_parts`` bf16 parts (three: exact). Slices past a request's length exit after
  writing their (empty) running max;
- the combine merges the slices of each (request, head).
With three parts each, the result is the fp32 torch maths up to summation order. Measured speed,
errors and the launch shapes tried: docs/performance.md ("Decode kernels alone").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.fit.footprint import Footprint
from sglang.kernels.fit.limits import DeviceLimits
from sglang.kernels.ops.attention.online_softmax import (
    EMPTY,
    kernel_head_dim_ok,
    online_softmax_step,
    slice_weight,
)
from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat, fp8_constexprs, load_rows
from sglang.kernels.ops.split_plan import split_blocks
from sglang.kernels.ops.triton_dispatch import interpreter_enabled


@dataclass(frozen=True)
class AbsorbedDecodeConfig:
    """Launch shape of the split kernel. ``heads_minor``: the dots put the keys / latent columns
    in the MMA's M dimension and the heads in N (Hopper's wgmma needs M >= 64; the heads of one
    program are fewer); else heads are M. ``q_resident``: the query parts are loaded once per
    program, else once per key tile (from L2)."""

    group: int = 16
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    heads_minor: bool = False
    q_resident: bool = True
    target_programs: int = 264  # two waves of the H200's 132 SMs
    min_split_keys: int = 256  # fewer keys a slice: the query load and the combine dominate
    combine_heads: int = 1  # heads a combine program merges (more: fewer, longer programs)


# heads in M (mma.sync), 16 heads x 64 keys, 8 warps: the fastest exact config measured at bs 1
# and 16 (docs/performance.md)
DEFAULT_CONFIG = AbsorbedDecodeConfig()
# FP8 latents: 32-key tiles (the dequantisation's temporaries spilled 2.4 KB at 64 on sm_90)
FP8_CONFIG = AbsorbedDecodeConfig(block_n=32)


@triton.jit
def _split_query_kernel(
    lat_ptr,
    pe_ptr,
    parts_ptr,
    heads,
    lat_sb,
    lat_sh,
    pe_sb,
    pe_sh,
    L: tl.constexpr,
    P: tl.constexpr,
    H: tl.constexpr,
    LAT_PARTS: tl.constexpr,
    PE_PARTS: tl.constexpr,
    PARTS: tl.constexpr,
):
    """Heads ``H * program_id(1) ..`` of request ``program_id(0)`` as parts in ``parts [bs,
    PARTS, heads, L + P]`` (the store's dtype): part ``i`` rounds what parts ``0 .. i - 1``
    left."""
    b = tl.program_id(0)
    h = tl.program_id(1) * H + tl.arange(0, H)
    ok = h < heads
    lat_cols = tl.arange(0, L)
    pe_cols = tl.arange(0, P)
    x = tl.load(
        lat_ptr + b * lat_sb + h[:, None] * lat_sh + lat_cols[None, :], mask=ok[:, None]
    ).to(tl.float32)
    y = tl.load(pe_ptr + b * pe_sb + h[:, None] * pe_sh + pe_cols[None, :], mask=ok[:, None])
    y = y.to(tl.float32)
    for i in tl.static_range(LAT_PARTS):
        row = parts_ptr + ((b * PARTS + i) * heads + h).to(tl.int64) * (L + P)
        part = x.to(parts_ptr.dtype.element_ty)
        tl.store(row[:, None] + lat_cols[None, :], part, mask=ok[:, None])
        x = x - part.to(tl.float32)
    for i in tl.static_range(PE_PARTS):
        row = parts_ptr + ((b * PARTS + i) * heads + h).to(tl.int64) * (L + P)
        part = y.to(parts_ptr.dtype.element_ty)
        tl.store(row[:, None] + L + pe_cols[None, :], part, mask=ok[:, None])
        y = y - part.to(tl.float32)


@triton.jit
def _qk(q, k, acc, HEADS_MINOR: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc + q [G, D] . k [N, D]^T -> [G, N]`` fp32 (accumulated in place by the MMA)."""
    if DOT_F32:  # the interpreter's bf16 dot is wrong; fp32 operands hold bf16 values exactly
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    if HEADS_MINOR:
        return tl.trans(tl.dot(k, tl.trans(q), tl.trans(acc), input_precision="ieee"))
    return tl.dot(q, tl.trans(k), acc, input_precision="ieee")


@triton.jit
def _pv(p, v, acc, HEADS_MINOR: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc + p [G, N] . v [N, D] -> [G, D]`` fp32."""
    if DOT_F32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    if HEADS_MINOR:
        return tl.trans(tl.dot(tl.trans(v), tl.trans(p), tl.trans(acc), input_precision="ieee"))
    return tl.dot(p, v, acc, input_precision="ieee")


@triton.jit
def _load_query(parts_ptr, b, i, h, h_ok, heads, cols, off, PARTS: tl.constexpr, W: tl.constexpr):
    """Part ``i`` of the queries of heads ``h`` (columns ``off + cols``); padded heads are 0."""
    rows = ((b * PARTS + i) * heads + h).to(tl.int64) * W + off
    return tl.load(parts_ptr + rows[:, None] + cols[None, :], mask=h_ok[:, None], other=0.0)


@triton.jit
def _scores(
    parts_ptr,
    q0,
    q1,
    q2,
    e0,
    e1,
    e2,
    ckv,
    kpe,
    s,
    b,
    h,
    h_ok,
    heads,
    lat_cols,
    pe_cols,
    L: tl.constexpr,
    P: tl.constexpr,
    LAT_PARTS: tl.constexpr,
    PE_PARTS: tl.constexpr,
    PARTS: tl.constexpr,
    Q_RESIDENT: tl.constexpr,
    HEADS_MINOR: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """``s +`` the unscaled scores ``[G, N]`` of one key tile, part by part (resident parts or
    reloaded)."""
    if not Q_RESIDENT:
        q0 = _load_query(parts_ptr, b, 0, h, h_ok, heads, lat_cols, 0, PARTS, L + P)
        e0 = _load_query(parts_ptr, b, 0, h, h_ok, heads, pe_cols, L, PARTS, L + P)
    s = _qk(q0, ckv, s, HEADS_MINOR, DOT_F32)
    s = _qk(e0, kpe, s, HEADS_MINOR, DOT_F32)
    if LAT_PARTS > 1:
        if not Q_RESIDENT:
            q1 = _load_query(parts_ptr, b, 1, h, h_ok, heads, lat_cols, 0, PARTS, L + P)
        s = _qk(q1, ckv, s, HEADS_MINOR, DOT_F32)
    if LAT_PARTS > 2:
        if not Q_RESIDENT:
            q2 = _load_query(parts_ptr, b, 2, h, h_ok, heads, lat_cols, 0, PARTS, L + P)
        s = _qk(q2, ckv, s, HEADS_MINOR, DOT_F32)
    if PE_PARTS > 1:
        if not Q_RESIDENT:
            e1 = _load_query(parts_ptr, b, 1, h, h_ok, heads, pe_cols, L, PARTS, L + P)
        s = _qk(e1, kpe, s, HEADS_MINOR, DOT_F32)
    if PE_PARTS > 2:
        if not Q_RESIDENT:
            e2 = _load_query(parts_ptr, b, 2, h, h_ok, heads, pe_cols, L, PARTS, L + P)
        s = _qk(e2, kpe, s, HEADS_MINOR, DOT_F32)
    return s


@triton.jit
def _split_kernel(
    parts_ptr,
    store_ptr,
    table_ptr,
    len_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    heads,
    table_stride,
    rows_per_block,
    block_stride,
    keys_per_split,
    n_splits,
    scale,
    L: tl.constexpr,
    P: tl.constexpr,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LAT_PARTS: tl.constexpr,
    PE_PARTS: tl.constexpr,
    PARTS: tl.constexpr,
    P_PARTS: tl.constexpr,
    Q_RESIDENT: tl.constexpr,
    HEADS_MINOR: tl.constexpr,
    DOT_F32: tl.constexpr,
    FP8: tl.constexpr,
    FP8_F: tl.constexpr,
    FP8_ROPE: tl.constexpr,
    FP8_ROPE_OFF: tl.constexpr,
    FP8_SCALE_OFF: tl.constexpr,
    FP8_G: tl.constexpr,
    FP8_NG: tl.constexpr,
    FP8_SCALES: tl.constexpr,
    FP8_ROW: tl.constexpr,
):
    hg = tl.program_id(0)  # fastest: the head groups of one key slice share its tiles in L2
    b = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(len_ptr + b).to(tl.int32)
    start = sp * keys_per_split
    end = tl.minimum(start + keys_per_split, n)
    h = hg * G + tl.arange(0, G)
    h_ok = h < heads  # fewer heads than G: the tile is padded (a dot needs 16 rows)
    lat_cols = tl.arange(0, L)
    pe_cols = tl.arange(0, P)
    row = (b * heads + h).to(tl.int64) * n_splits + sp  # [G] partial rows
    m = tl.full([G], EMPTY, tl.float32)
    if start < end:
        q0 = tl.zeros([G, L], parts_ptr.dtype.element_ty)
        q1 = q0
        q2 = q0
        e0 = tl.zeros([G, P], parts_ptr.dtype.element_ty)
        e1 = e0
        e2 = e0
        if Q_RESIDENT:
            q0 = _load_query(parts_ptr, b, 0, h, h_ok, heads, lat_cols, 0, PARTS, L + P)
            e0 = _load_query(parts_ptr, b, 0, h, h_ok, heads, pe_cols, L, PARTS, L + P)
            if LAT_PARTS > 1:
                q1 = _load_query(parts_ptr, b, 1, h, h_ok, heads, lat_cols, 0, PARTS, L + P)
            if LAT_PARTS > 2:
                q2 = _load_query(parts_ptr, b, 2, h, h_ok, heads, lat_cols, 0, PARTS, L + P)
            if PE_PARTS > 1:
                e1 = _load_query(parts_ptr, b, 1, h, h_ok, heads, pe_cols, L, PARTS, L + P)
            if PE_PARTS > 2:
                e2 = _load_query(parts_ptr, b, 2, h, h_ok, heads, pe_cols, L, PARTS, L + P)
        l_sum = tl.zeros([G], tl.float32)
        acc = tl.zeros([G, L], tl.float32)
        table_row = table_ptr + b.to(tl.int64) * table_stride
        for j0 in range(start, end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            live = j < end
            blk = tl.load(table_row + j // rows_per_block, mask=live, other=0).to(tl.int64)
            if FP8:  # dequantised into bf16 values (the query parts' dtype), exactly
                off = blk * block_stride + (j % rows_per_block).to(tl.int64) * FP8_ROW
                ckv = load_rows(
                    store_ptr, off, live, 0, L, FP8_F, FP8_ROPE, FP8_ROPE_OFF, FP8_SCALE_OFF, FP8_G,
                ).to(parts_ptr.dtype.element_ty)  # fmt: skip
                kpe = load_rows(
                    store_ptr, off, live, L, P, FP8_F, FP8_ROPE, FP8_ROPE_OFF, FP8_SCALE_OFF, FP8_G,
                ).to(parts_ptr.dtype.element_ty)  # fmt: skip
            else:
                key = store_ptr + blk * block_stride + (j % rows_per_block).to(tl.int64) * (L + P)
                ckv = tl.load(key[:, None] + lat_cols[None, :], mask=live[:, None], other=0.0)
                kpe = tl.load(key[:, None] + L + pe_cols[None, :], mask=live[:, None], other=0.0)
            s = _scores(
                parts_ptr,
                q0,
                q1,
                q2,
                e0,
                e1,
                e2,
                ckv,
                kpe,
                tl.zeros([G, BLOCK_N], tl.float32),
                b,
                h,
                h_ok,
                heads,
                lat_cols,
                pe_cols,
                L,
                P,
                LAT_PARTS,
                PE_PARTS,
                PARTS,
                Q_RESIDENT,
                HEADS_MINOR,
                DOT_F32,
            )
            s = tl.where(live[None, :], s * scale, float("-inf"))
            m_new, alpha, prob, l_sum = online_softmax_step(s, m, l_sum)
            # the fp32 probabilities as P_PARTS parts of the latents' dtype (three: all 24 bits)
            hi = prob.to(ckv.dtype)
            acc = _pv(hi, ckv, acc * alpha[:, None], HEADS_MINOR, DOT_F32)
            if P_PARTS > 1:
                rest = prob - hi.to(tl.float32)
                mid = rest.to(ckv.dtype)
                acc = _pv(mid, ckv, acc, HEADS_MINOR, DOT_F32)
                if P_PARTS > 2:
                    lo = (rest - mid.to(tl.float32)).to(ckv.dtype)
                    acc = _pv(lo, ckv, acc, HEADS_MINOR, DOT_F32)
            m = m_new
        tl.store(part_l_ptr + row, l_sum, mask=h_ok)
        tl.store(part_o_ptr + row[:, None] * L + lat_cols[None, :], acc, mask=h_ok[:, None])
    tl.store(part_m_ptr + row, m, mask=h_ok)


@triton.jit
def _combine_kernel(
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    heads,
    n_splits,
    L: tl.constexpr,
    H: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Heads ``H * program_id(1) ..`` of request ``program_id(0)``: the slices' partial sums,
    rescaled to their common max."""
    b = tl.program_id(0)
    h = tl.program_id(1) * H + tl.arange(0, H)
    ok = h < heads
    r = (b * heads + h).to(tl.int64)  # [H] output rows
    s = tl.arange(0, SPLITS)
    cols = tl.arange(0, L)
    base = r * n_splits
    m = tl.load(
        part_m_ptr + base[:, None] + s[None, :],
        mask=ok[:, None] & (s < n_splits)[None, :],
        other=EMPTY,
    )
    top = tl.max(m, axis=1)
    w = slice_weight(m, top[:, None])  # [H, SPLITS]
    used = w > 0.0
    lsum = tl.load(part_l_ptr + base[:, None] + s[None, :], mask=used, other=0.0)
    denom = tl.sum(w * lsum, axis=1)
    o = tl.zeros([H, L], tl.float32)
    for i in range(n_splits):  # one slice at a time: [H, SPLITS, L] would not fit in registers
        m_i = tl.load(part_m_ptr + base + i, mask=ok, other=EMPTY)
        w_i = slice_weight(m_i, top)
        o_i = tl.load(
            part_o_ptr + (base + i)[:, None] * L + cols[None, :],
            mask=(w_i > 0.0)[:, None],
            other=0.0,
        )
        o += w_i[:, None] * o_i
    # no live key (a padded row): o is 0, and so is the output
    tl.store(
        out_ptr + r[:, None] * L + cols[None, :],
        o / tl.where(denom > 0.0, denom, 1.0)[:, None],
        mask=ok[:, None],
    )


def absorbed_decode_unsupported(
    latent: int, rope: int, store_dtype: torch.dtype, fp8: Fp8RowFormat | None = None
) -> str | None:
    """Why the kernel cannot take these widths / this store (``fp8``: FP8 latent rows), or
    None."""
    if fp8 is not None:
        if store_dtype != torch.uint8 or fp8.dim != latent + rope or fp8.rope != rope:
            return f"FP8 latents need uint8 rows of {latent} e4m3 + {rope} bf16 values"
    elif store_dtype not in (torch.bfloat16, torch.float16):
        return f"the latent store is {store_dtype}, the kernel reads bf16 or fp16"
    if not (kernel_head_dim_ok(latent) and kernel_head_dim_ok(rope)):
        return f"latent {latent} and rope {rope} widths must be powers of two >= 16"
    return None


def absorbed_decode_footprint(
    latent: int, rope: int, q_parts: int, config: AbsorbedDecodeConfig = DEFAULT_CONFIG
) -> Footprint:
    """One split program: the ``group`` heads' query parts and a ``block_n``-key tile of
    ``latent + rope`` half-precision columns (two copies with ``heads_minor``: the transposed
    operand of the second dot), plus 2 KiB of reduction scratch; the sm_90 compiler of Triton
    3.6 (the H200's), an upper bound for 3.9."""
    width = latent + rope
    key_tiles = 2 if config.heads_minor else 1
    shared = (q_parts * config.group + key_tiles * config.block_n) * width * 2 + 2048
    return Footprint(shared, config.num_warps)


def absorbed_decode_unfit_reason(
    latent: int,
    rope: int,
    store_dtype: torch.dtype,
    limits: DeviceLimits | None,
    fp8: Fp8RowFormat | None = None,
    *,
    q_parts: int = 3,
    config: AbsorbedDecodeConfig | None = None,
) -> str | None:
    """None when the kernel runs these widths over a ``store_dtype`` store (``fp8``: FP8 latent
    rows) here with fp32 queries in ``q_parts`` parts, else why not
    (:func:`absorbed_decode_unsupported`, the family off, a program over the device's limits).
    ``config``: the tiles (default: the ones the kernel takes for this store)."""
    why = absorbed_decode_unsupported(latent, rope, store_dtype, fp8)
    if why is not None:
        return why
    if config is None:
        config = DEFAULT_CONFIG if fp8 is None else FP8_CONFIG
    fp = absorbed_decode_footprint(latent, rope, q_parts, config)
    return unfit_reason("absorbed_mla_decode", fp, limits)


def split_plan(
    bs: int, head_groups: int, max_keys: int, config: AbsorbedDecodeConfig
) -> tuple[int, int]:
    """(slices a request's keys are cut into, keys per slice): about ``target_programs``
    programs, no slice shorter than ``min_split_keys`` (or one key tile)."""
    want = triton.cdiv(config.target_programs, max(bs * head_groups, 1))
    cap = triton.cdiv(max_keys, max(config.min_split_keys, config.block_n))
    return split_blocks(max(max_keys, 1), config.block_n, min(want, cap, 64))


def _parts_for(t: torch.Tensor, store_dtype: torch.dtype, parts: int) -> int:
    return 1 if t.dtype == store_dtype else parts


def absorbed_mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    store: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    q_parts: int = 3,
    p_parts: int = 3,
    config: AbsorbedDecodeConfig | None = None,
    fp8: Fp8RowFormat | None = None,
) -> torch.Tensor:
    """``q_lat [bs, heads, L]`` and ``q_pe [bs, heads, P]`` (fp32, or the store's dtype: then one
    exact part) over the paged latents ``store [num_blocks, R, L + P]`` (bf16/fp16) of each
    request through ``table [bs, nb]`` (row ``j`` of request ``b`` is
    ``store[table[b, j // R], j % R]``), the first ``lengths[b]`` rows live (``<= nb * R``; 0:
    the output row is zero) -> ``o_lat [bs, heads, L]`` fp32. The key slices cover ``nb * R``
    keys: slice ``table`` to the longest request's blocks when the host knows it.
    ``q_parts`` / ``p_parts``: bf16 parts of the fp32 queries / probabilities (3: exact).
    ``fp8``: the store holds FP8 latent rows ``[num_blocks, R, row_bytes]`` uint8 (the latent
    part e4m3, the rope part bf16), dequantised into bf16 values as they are read."""
    bs, heads, latent = q_lat.shape
    rope = q_pe.shape[-1]
    if config is None:
        config = DEFAULT_CONFIG if fp8 is None else FP8_CONFIG
    why = absorbed_decode_unsupported(latent, rope, store.dtype, fp8)
    if why is not None:
        raise ValueError(why)
    width = latent + rope if fp8 is None else fp8.row_bytes
    if q_pe.shape[:2] != (bs, heads) or store.dim() != 3 or store.shape[-1] != width:
        raise ValueError(
            f"absorbed decode shapes disagree: q_lat {tuple(q_lat.shape)}, q_pe "
            f"{tuple(q_pe.shape)}, store {tuple(store.shape)} (want [blocks, rows, {width}])"
        )
    if store.stride(2) != 1 or store.stride(1) != width:
        raise ValueError("the latent store must hold contiguous rows")
    if table.dim() != 2 or table.shape[0] != bs or table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"table must be [bs={bs}, blocks] int32/int64, got {tuple(table.shape)}")
    if lengths.shape != (bs,):
        raise ValueError(f"lengths must be [bs={bs}], got {tuple(lengths.shape)}")
    if not (1 <= q_parts <= 3 and 1 <= p_parts <= 3):
        raise ValueError(f"q_parts and p_parts must be 1..3, got {q_parts}, {p_parts}")
    if config.group < 16 or config.group & (config.group - 1):
        raise ValueError(f"group must be a power of two >= 16, got {config.group}")
    if config.combine_heads < 1 or config.combine_heads & (config.combine_heads - 1):
        raise ValueError(f"combine_heads must be a power of two, got {config.combine_heads}")
    out = torch.empty(bs, heads, latent, dtype=torch.float32, device=q_lat.device)
    if bs == 0:
        return out
    if table.stride(1) != 1:
        table = table.contiguous()
    # the dtype the keys are read in: the store's, or bf16 for FP8 rows (their exact values)
    key_dtype = store.dtype if fp8 is None else torch.bfloat16
    lat_parts = _parts_for(q_lat, key_dtype, q_parts)
    pe_parts = _parts_for(q_pe, key_dtype, q_parts)
    n_parts = max(lat_parts, pe_parts)
    parts = torch.empty(bs, n_parts, heads, latent + rope, dtype=key_dtype, device=q_lat.device)
    for t in (q_lat, q_pe):
        if t.stride(-1) != 1:
            raise ValueError("the queries' last dimension must be contiguous")
    _split_query_kernel[(bs, triton.cdiv(heads, 16))](
        q_lat,
        q_pe,
        parts,
        heads,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        L=latent,
        P=rope,
        H=16,
        LAT_PARTS=lat_parts,
        PE_PARTS=pe_parts,
        PARTS=n_parts,
        num_warps=4,
    )
    n_groups = triton.cdiv(heads, config.group)
    max_keys = table.shape[1] * store.shape[1]
    n_splits, per_split = split_plan(bs, n_groups, max_keys, config)
    part_o = torch.empty(bs * heads * n_splits, latent, dtype=torch.float32, device=q_lat.device)
    part_m = torch.empty(bs * heads * n_splits, dtype=torch.float32, device=q_lat.device)
    part_l = torch.empty_like(part_m)
    _split_kernel[(n_groups, bs, n_splits)](
        parts,
        store,
        table,
        lengths,
        part_o,
        part_m,
        part_l,
        heads,
        table.stride(0),
        store.shape[1],
        store.stride(0),
        per_split,
        n_splits,
        float(scale),
        L=latent,
        P=rope,
        G=config.group,
        BLOCK_N=config.block_n,
        LAT_PARTS=lat_parts,
        PE_PARTS=pe_parts,
        PARTS=n_parts,
        P_PARTS=p_parts,
        Q_RESIDENT=config.q_resident,
        HEADS_MINOR=config.heads_minor,
        DOT_F32=interpreter_enabled(),
        **fp8_constexprs(fp8),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    ch = config.combine_heads
    _combine_kernel[(bs, triton.cdiv(heads, ch))](
        part_o,
        part_m,
        part_l,
        out,
        heads,
        n_splits,
        L=latent,
        H=ch,
        SPLITS=max(2, triton.next_power_of_2(n_splits)),
        num_warps=4,
    )
    return out
