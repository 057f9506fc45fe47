"""Sparse prefill attention for DeepSeek V4: one request's new queries, each over its window rows,
its compressed entries and a per-head sink, in one online softmax (flash attention).

Query ``i`` sits at position ``p = q_first + i`` and attends:
- the raw KV rows of positions ``max(p - window + 1, win_first) .. p`` (rows of ``win_kv``, whose
  row 0 is position ``win_first``);
- with ``picks [n, K]`` (the indexer's top-k ids, best first) its first
  ``min(K, (p + 1) // ratio)`` picks (the indexer's stable sort puts every visible entry before the
  invisible ones), else entries ``0 .. min(N, (p + 1) // ratio) - 1``;
- the sink: an extra logit per head whose value row is zero.
K = V, one KV head shared by all heads (MQA): a program takes ``G`` heads of one query, so each key
tile is read once for ``G`` heads. Only the rows a query sees are read; nothing is gathered. The
entries may be FP8 rows (``--kv-cache-dtype fp8_e4m3``: ``quant/fp8_rows.py``), dequantised in
the key tile into bf16 values, so the exactness below holds for them as read.

Exactness: keys are bf16, so ``q . k`` is exact per product when q is bf16 (one part) or split
into three bf16 parts (an fp32 q: 8 + 8 + 8 significant bits). The fp32 probabilities enter the
value product as ``pv_parts`` bf16 parts: three hold all 24 bits (every product is then the fp32
torch path's; only the summation order and the exp rounding differ), two keep 16 bits, one 8.
Accumulation is fp32 throughout. The default is two parts: at the bench width (8192 queries,
64 heads of 512, ratio 4 top-512) on the H200 the worst query's error against the torch path was
2.6e-6 with two parts and 2.3e-6 with three (the summation-order floor), one part 1.0e-3, and two
parts ran in 7.5 ms against three's 8.8 (``scripts/bench_sparse_prefill.py``, docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.fit.footprint import Footprint
from sglang.kernels.fit.limits import DeviceLimits
from sglang.kernels.ops.attention.online_softmax import kernel_head_dim_ok, online_softmax_step
from sglang.kernels.ops.interp_dot import dot
from sglang.kernels.ops.quant.fp8_rows import (
    Fp8RowFormat,
    fp8_constexprs,
    fp8_rows_reason,
    load_rows,
)
from sglang.kernels.ops.triton_dispatch import interpreter_enabled

_SPLIT_PARTS = 3  # bf16 parts that hold an fp32 significand (8 + 8 + 8 bits)


@triton.jit
def _tile_update(
    q0,
    q1,
    q2,
    k,
    live,
    m,
    l_sum,
    acc,
    scale,
    Q_PARTS: tl.constexpr,
    PV_PARTS: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One key tile ``k [BLOCK_N, D]`` (rows where ``live``) into the running max ``m``, sum
    ``l_sum`` and output ``acc`` of ``G`` heads."""
    kt = tl.trans(k)
    s = dot(q0, kt, None, DOT_F32)
    if Q_PARTS > 1:
        s = dot(q1, kt, s, DOT_F32)
    if Q_PARTS > 2:
        s = dot(q2, kt, s, DOT_F32)
    s = s * scale
    s = tl.where(live[None, :], s, float("-inf"))
    m_new, alpha, prob, l_sum = online_softmax_step(s, m, l_sum)
    hi = prob.to(k.dtype)
    pv = dot(hi, k, None, DOT_F32)
    if PV_PARTS > 1:
        rest = prob - hi.to(tl.float32)
        mid = rest.to(k.dtype)
        pv = dot(mid, k, pv, DOT_F32)
        if PV_PARTS > 2:
            pv = dot((rest - mid.to(tl.float32)).to(k.dtype), k, pv, DOT_F32)
    acc = acc * alpha[:, None] + pv
    return m_new, l_sum, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    win_ptr,
    ent_ptr,
    picks_ptr,
    sink_ptr,
    out_ptr,
    heads,
    q_first,
    win_first,
    window,
    n_entry_max,
    picks_stride,
    q_part_stride,
    ratio,
    scale,
    D: tl.constexpr,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ENTRIES: tl.constexpr,
    INDEXED: tl.constexpr,
    Q_PARTS: tl.constexpr,
    PV_PARTS: tl.constexpr,
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
    i = tl.program_id(0).to(tl.int64)
    hg = tl.program_id(1)
    p = q_first + i
    h = hg * G + tl.arange(0, G)
    h_ok = h < heads  # fewer heads than G: the tile is padded (a dot needs 16 rows)
    cols = tl.arange(0, D)
    qo = (i * heads + h)[:, None] * D + cols[None, :]  # [G, D] offsets of q and out
    q0 = tl.load(q_ptr + qo, mask=h_ok[:, None], other=0.0)
    q1 = q0
    q2 = q0
    if Q_PARTS > 1:
        q1 = tl.load(q_ptr + q_part_stride + qo, mask=h_ok[:, None], other=0.0)
    if Q_PARTS > 2:
        q2 = tl.load(q_ptr + 2 * q_part_stride + qo, mask=h_ok[:, None], other=0.0)
    # The sink is the first "key": m starts at its logit and l at exp(0); its value row is zero.
    m = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    l_sum = tl.full([G], 1.0, tl.float32)
    acc = tl.zeros([G, D], tl.float32)

    lo = tl.maximum(p - window + 1, win_first) - win_first
    end = p - win_first + 1
    for j0 in range(lo, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        live = j < end
        k = tl.load(win_ptr + j[:, None] * D + cols[None, :], mask=live[:, None], other=0.0)
        m, l_sum, acc = _tile_update(
            q0, q1, q2, k, live, m, l_sum, acc, scale, Q_PARTS, PV_PARTS, DOT_F32
        )

    if HAS_ENTRIES:
        n_ent = tl.minimum((p + 1) // ratio, n_entry_max)
        for j0 in range(0, n_ent, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            live = j < n_ent
            if INDEXED:
                e = tl.load(picks_ptr + i * picks_stride + j, mask=live, other=0).to(tl.int64)
            else:
                e = j.to(tl.int64)
            if FP8:  # dequantised into bf16 values: the window rows' dtype, exactly
                k = load_rows(
                    ent_ptr, e * FP8_ROW, live, 0, D,
                    FP8_F, FP8_ROPE, FP8_ROPE_OFF, FP8_SCALE_OFF, FP8_G,
                ).to(win_ptr.dtype.element_ty)  # fmt: skip
            else:
                k = tl.load(ent_ptr + e[:, None] * D + cols[None, :], mask=live[:, None], other=0.0)
            m, l_sum, acc = _tile_update(
                q0, q1, q2, k, live, m, l_sum, acc, scale, Q_PARTS, PV_PARTS, DOT_F32
            )
    tl.store(out_ptr + qo, acc / l_sum[:, None], mask=h_ok[:, None])


def prefill_footprint(
    head_dim: int, q_parts: int, group: int = 16, block_n: int = 32, num_warps: int = 4
) -> Footprint:
    """One program: the ``group`` heads' query parts and a key tile of ``block_n`` rows in
    shared memory (bf16), staged for the two dots (sm_90 compiler: ``D * (2G * parts + 2 *
    block_n) + 1 KiB``)."""
    return Footprint(head_dim * (2 * group * q_parts + 2 * block_n) + 1024, num_warps)


def prefill_unfit_reason(
    head_dim: int, key_dtype: torch.dtype, q_dtype: torch.dtype, limits: DeviceLimits | None
) -> str | None:
    """None when the kernel runs here for these widths and dtypes, else why not (shapes,
    :func:`prefill_shape_reason`; the family off; a program over the device's limits)."""
    why = prefill_shape_reason(head_dim, key_dtype)
    if why is not None:
        return why
    parts = 1 if q_dtype == torch.bfloat16 else _SPLIT_PARTS
    return unfit_reason("sparse_prefill_attention", prefill_footprint(head_dim, parts), limits)


def prefill_shape_reason(head_dim: int, key_dtype: torch.dtype) -> str | None:
    """None when the kernel takes rows of ``head_dim`` ``key_dtype`` values, else why not."""
    if not kernel_head_dim_ok(head_dim):
        return f"head dim {head_dim} is not a power of two >= 16"
    if key_dtype != torch.bfloat16:
        return f"keys are {key_dtype}, the kernel reads bf16"
    return None


def split_bf16(x: torch.Tensor, parts: int) -> torch.Tensor:
    """``x`` (fp32) as ``parts`` bf16 tensors stacked on a new dim 0 whose sum approximates it;
    three parts hold all 24 significant bits (exact)."""
    out = torch.empty((parts, *x.shape), dtype=torch.bfloat16, device=x.device)
    rest = x.float()
    for a in range(parts):
        out[a] = rest.to(torch.bfloat16)
        rest = rest - out[a].float()
    return out


def sparse_prefill_attention(
    q: torch.Tensor,
    q_first: int,
    win_kv: torch.Tensor,
    win_first: int,
    sink: torch.Tensor,
    *,
    scale: float,
    window: int,
    entries: torch.Tensor | None = None,
    ratio: int = 0,
    picks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    pv_parts: int = 2,
    heads_per_program: int = 16,
    block_n: int = 32,
    num_warps: int | None = None,
    num_stages: int = 2,
    entry_fp8: Fp8RowFormat | None = None,
) -> torch.Tensor:
    """``q [n, heads, D]`` (bf16, or fp32 split into three bf16 parts) at positions
    ``q_first .. q_first + n - 1``; ``win_kv [m, D]`` (bf16) the raw rows of positions
    ``win_first ..``, covering every query's window; ``sink [heads]``; with ``ratio``, the
    compressed ``entries [N, D]`` (bf16; with ``entry_fp8`` FP8 rows ``[N, row_bytes]`` uint8,
    dequantised as they are read) and, for indexed layers, ``picks [n, K]`` (entry ids best
    first).
    Writes fp32 ``[n, heads, D]`` into ``out`` (contiguous; allocated when None) and returns it."""
    n, heads, d = q.shape
    if out is None:
        out = torch.empty(n, heads, d, dtype=torch.float32, device=q.device)
    elif out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 {tuple(q.shape)}, got {tuple(out.shape)}")
    if n == 0:
        return out
    reason = prefill_shape_reason(d, win_kv.dtype)
    if reason is not None:
        raise ValueError(reason)
    if entries is not None and entry_fp8 is not None:
        why = fp8_rows_reason(entries, entry_fp8)
        if why is not None or entry_fp8.dim != d:
            raise ValueError(why or f"FP8 rows of {entry_fp8.dim} values for head dim {d}")
    elif entries is not None and (entries.shape[-1] != d or entries.dtype != win_kv.dtype):
        raise ValueError(
            f"entries {entries.dtype} {tuple(entries.shape)} are not {d}-wide {win_kv.dtype} rows"
        )
    if win_kv.shape[-1] != d:
        raise ValueError(f"window rows must be {d} wide like q")
    if win_first > q_first or q_first + n - win_first > win_kv.shape[0]:
        raise ValueError(
            f"win_kv holds positions {win_first} .. {win_first + win_kv.shape[0] - 1}, "
            f"the queries reach {q_first} .. {q_first + n - 1}"
        )
    if entries is not None and ratio <= 0:
        raise ValueError("compressed entries need their ratio")
    if picks is not None and (entries is None or picks.shape[0] != n):
        raise ValueError("picks need the entries they index and one row per query")
    if pv_parts not in (1, 2, 3):
        raise ValueError(f"pv_parts must be 1, 2 or 3, got {pv_parts}")
    if q.dtype == torch.bfloat16:
        qs = q.contiguous()
        q_parts = 1
    else:  # an exact fp32 q . k needs its 24 bits in three bf16 parts
        qs = split_bf16(q, _SPLIT_PARTS)
        q_parts = _SPLIT_PARTS
    win_kv = win_kv.contiguous()
    has_entries = entries is not None and entries.shape[0] > 0
    # FP8 entries default to 8 warps: the dequantisation's temporaries spilled at 4 (sm_90)
    fp8 = has_entries and entry_fp8 is not None
    ent = entries.contiguous() if has_entries else win_kv
    indexed = has_entries and picks is not None
    if indexed:
        picks = picks.contiguous()
    n_entry_max = 0
    if has_entries:
        n_entry_max = picks.shape[1] if indexed else ent.shape[0]
        n_entry_max = min(n_entry_max, ent.shape[0])
    # G heads a program (>= 16: the dot's smallest M; fewer heads are padded)
    group = min(heads_per_program, max(16, triton.next_power_of_2(heads)))
    _prefill_kernel[(n, triton.cdiv(heads, group))](
        qs,
        win_kv,
        ent,
        picks if indexed else win_kv,
        sink,
        out,
        heads,
        q_first,
        win_first,
        window,
        n_entry_max,
        picks.stride(0) if indexed else 0,
        n * heads * d,
        max(ratio, 1),
        float(scale),
        D=d,
        G=group,
        BLOCK_N=block_n,
        HAS_ENTRIES=has_entries,
        INDEXED=indexed,
        Q_PARTS=q_parts,
        PV_PARTS=pv_parts,
        DOT_F32=interpreter_enabled(),
        **fp8_constexprs(entry_fp8 if fp8 else None),
        num_warps=num_warps or (8 if fp8 else 4),
        num_stages=num_stages,
    )
    return out
