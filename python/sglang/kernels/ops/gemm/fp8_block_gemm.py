"""W8A8 block-FP8 GEMM in Triton: ``y[M, N] = dequant(A) @ dequant(W)^T``.

``A`` is FP8 e4m3 ``[M, K]`` with one fp32 scale per row per 128 values of K (the activation
quantiser's ``per_token_group_quant_fp8``), ``W`` is FP8 e4m3 ``[N, K]`` with one fp32 scale per
128 x 128 tile (the checkpoint's block scales). Each K block's FP8 product is scaled by its row
and tile scales before it joins the fp32 accumulator, as DeepGEMM's SM90 kernel does; the output
is bf16 or fp16 (or, see below, FP8 again).

One kernel serves three uses:
- the plain GEMM (``groups = 1``);
- the grouped GEMM of DeepSeek V4's ``wo_a`` (block-diagonal): ``A [M, G, K]``, ``W [G * N, K]``,
  group ``g``'s rows of A times W's rows ``g*N .. g*N+N-1`` into output columns ``g*N ..``; the
  group is the grid's third axis, one launch for all groups;
- split-K (decode sizes, see ``fp8_gemm_config``): each CTA sums a range of K blocks into an fp32
  partial, and :func:`_splitk_reduce_kernel` adds the partials in split order.

The epilogue may also quantise its output for the next FP8 GEMM (``quant_out``): the tile (128
columns, one activation group) is rounded to the output dtype, as the unfused path would store
it, then quantised with one scale per row, so the next layer needs no quantiser launch.

N and K need not be multiples of 128 (partial tiles and scale blocks are masked); A's rows may be
zero-padded past K. :func:`fp8_block_gemm_torch` / :func:`fp8_grouped_gemm_torch` are the torch
references (the CPU path of the layers) with the same maths: dequantise both operands to fp32,
multiply, round once. Nothing here synchronises with the host, so every entry is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.limits import H200, device_limits
from sglang.kernels.ops.gemm.fp8_gemm_config import (
    FP8_SCALE_BLOCK,
    Fp8GemmConfig,
    choose_config,
    fit_to_shared,
)
from sglang.kernels.ops.quant.dtype_round import ROUND_CODES, round_to
from sglang.kernels.ops.quant.fp8 import (
    DEFAULT_EPS,
    FP8_DTYPE,
    block_dequant_fp8,
    empty_group_scales,
    per_token_group_quant_fp8,
    quant_rows_fp8,
)
from sglang.kernels.ops.split_plan import split_blocks
from sglang.kernels.ops.tile_order import grouped_tile

OUT_DTYPES = (torch.bfloat16, torch.float16)
# Epilogue modes (constexpr): the output dtype, fp32 split-K partials, FP8 + scales.
_OUT_PLAIN, _OUT_PARTIAL, _OUT_QUANT = 0, 1, 2


@triton.jit
def _store_quantised(q_ptr, s_ptr, rows, row_ok, cols, col_ok, group, y, eps, stride_qm,
                     stride_sm, stride_sk):  # fmt: skip
    """Quantise the tile ``y [rows, 128 columns]`` (one activation group) to e4m3 with one
    scale per row, and store both."""
    q, scale = quant_rows_fp8(tl.where(col_ok[None, :], y, 0.0), eps)
    q_ptrs = q_ptr + rows[:, None] * stride_qm + cols[None, :]
    tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    tl.store(s_ptr + rows * stride_sm + group * stride_sk, scale, mask=row_ok)


@triton.jit
def _load_k_step(row_ptr, row_ok, offs_k, k_ok, ROWS_FIRST: tl.constexpr):
    """One K step (columns ``offs_k``) of the rows at ``row_ptr``, 0 outside ``row_ok`` /
    ``k_ok``: ``[rows, BLOCK_K]`` for the MMA's left operand (``ROWS_FIRST``), else
    ``[BLOCK_K, rows]`` for its right one."""
    if ROWS_FIRST:
        tile = tl.load(
            row_ptr[:, None] + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
    else:
        tile = tl.load(
            row_ptr[None, :] + offs_k[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0
        )
    return tile


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    os_ptr,
    M,
    N,
    K,
    k_blocks_per_split,
    stride_am,
    stride_ag,
    stride_asm,
    stride_asg,
    stride_ask,
    stride_wn,
    stride_wsn,
    stride_wsk,
    stride_os,
    stride_om,
    stride_osm,
    stride_osk,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr,
    OUT_MODE: tl.constexpr,
    ROUND: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows = offs_m.to(tl.int64)
    w_rows = g * N + offs_n  # this group's weight rows (and output columns)
    a_row_ptr = a_ptr + g * stride_ag + rows * stride_am
    w_row_ptr = w_ptr + w_rows * stride_wn
    as_row_ptr = as_ptr + g * stride_asg + rows * stride_asm
    ws_row_ptr = ws_ptr + (w_rows // SCALE_BLOCK) * stride_wsn

    k_blocks = tl.cdiv(K, BLOCK_K)
    kb_first = pid_k * k_blocks_per_split
    kb_last = tl.minimum(kb_first + k_blocks_per_split, k_blocks)
    if SWAP_AB:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_first, kb_last):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        sk = (kb * BLOCK_K) // SCALE_BLOCK
        a_s = tl.load(as_row_ptr + sk * stride_ask, mask=m_ok, other=0.0)
        w_s = tl.load(ws_row_ptr + sk * stride_wsk, mask=n_ok, other=0.0)
        if SWAP_AB:
            # Weights on the MMA's M side: [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M].
            w = _load_k_step(w_row_ptr, n_ok, offs_k, k_ok, True)
            a = _load_k_step(a_row_ptr, m_ok, offs_k, k_ok, False)
            acc_t += tl.dot(w, a) * (w_s[:, None] * a_s[None, :])
        else:
            a = _load_k_step(a_row_ptr, m_ok, offs_k, k_ok, True)
            w = _load_k_step(w_row_ptr, n_ok, offs_k, k_ok, False)
            acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
    if SWAP_AB:
        acc = tl.trans(acc_t)

    out_mask = m_ok[:, None] & n_ok[None, :]
    if OUT_MODE == 1:  # fp32 partial of split pid_k
        ptrs = out_ptr + pid_k * stride_os + rows[:, None] * stride_om + w_rows[None, :]
        tl.store(ptrs, acc, mask=out_mask)
    elif OUT_MODE == 2:  # this tile is one activation group of the next GEMM's input
        group = (g * N + pid_n * BLOCK_N) // SCALE_BLOCK
        _store_quantised(out_ptr + g * N + pid_n * BLOCK_N, os_ptr, rows, m_ok,
                         tl.arange(0, BLOCK_N), n_ok, group, round_to(acc, ROUND), eps,
                         stride_om, stride_osm, stride_osk)  # fmt: skip
    else:
        ptrs = out_ptr + rows[:, None] * stride_om + w_rows[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _splitk_reduce_kernel(
    p_ptr,
    out_ptr,
    os_ptr,
    n_cols,
    splits,
    stride_ps,
    stride_pm,
    stride_om,
    stride_osm,
    stride_osk,
    eps,
    BLOCK_N: tl.constexpr,
    OUT_MODE: tl.constexpr,
    ROUND: tl.constexpr,
):
    """Row ``program_id(0)``, columns of block ``program_id(1)``: the sum of the split-K partials
    in split order, stored in the output dtype or (``OUT_MODE`` 2) quantised per 128 columns."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    ptrs = p_ptr + row * stride_pm + cols
    acc = tl.load(ptrs, mask=col_ok, other=0.0)
    for s in range(1, splits):
        acc += tl.load(ptrs + s * stride_ps, mask=col_ok, other=0.0)
    if OUT_MODE == 2:
        rows = row + tl.arange(0, 1)
        y = round_to(acc[None, :], ROUND)
        _store_quantised(out_ptr + tl.program_id(1) * BLOCK_N, os_ptr, rows, rows == row,
                         tl.arange(0, BLOCK_N), col_ok, tl.program_id(1), y, eps, stride_om,
                         stride_osm, stride_osk)  # fmt: skip
    else:
        tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def quant_activation_fp8(
    x: torch.Tensor, *, use_triton: bool | None = None, eps: float = DEFAULT_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM's A operand from ``x [..., K]``: ``per_token_group_quant_fp8`` per 128 values,
    scales MN-major (DeepGEMM's layout; the Triton kernel reads any). A ``K`` that is not a
    multiple of 128 is zero-padded first (zeros leave a group's scale unchanged), so ``q`` is
    ``[..., ceil(K/128) * 128]``."""
    k = x.shape[-1]
    pad = -k % FP8_SCALE_BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return per_token_group_quant_fp8(
        x, FP8_SCALE_BLOCK, eps, use_triton=use_triton, scale_mn_major=True
    )


# --- torch references --------------------------------------------------------------------------


def dequant_activation(q: torch.Tensor, scale: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """``q [..., Kp]`` (FP8, rows zero-padded past ``k``) times its per-128 ``scale [..., KB]``
    -> fp32 ``[..., k]``."""
    k = q.shape[-1] if k is None else k
    full = scale.float().repeat_interleave(FP8_SCALE_BLOCK, dim=-1)[..., :k]
    return q[..., :k].float() * full


def fp8_block_gemm_torch(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The same maths in torch: both operands dequantised to fp32, one fp32 product, one
    rounding to ``out_dtype``. ``a_q [M, Kp]``, ``w_q [N, K]`` -> ``[M, N]``."""
    k = w_q.shape[-1]
    a = dequant_activation(a_q, a_s, k)
    w = block_dequant_fp8(w_q, w_s.float(), (FP8_SCALE_BLOCK, FP8_SCALE_BLOCK))
    return (a @ w.T).to(out_dtype)


def fp8_grouped_gemm_torch(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Grouped: ``a_q [M, G, Kp]``, ``w_q [G * N, K]`` -> ``[M, G * N]``, group ``g`` of A times
    W's rows ``g*N ..``."""
    m, groups = a_q.shape[0], a_q.shape[1]
    k = w_q.shape[-1]
    a = dequant_activation(a_q, a_s, k)
    w = block_dequant_fp8(w_q, w_s.float(), (FP8_SCALE_BLOCK, FP8_SCALE_BLOCK))
    y = torch.einsum("mgk,gnk->mgn", a, w.view(groups, -1, k))
    return y.reshape(m, -1).to(out_dtype)


# --- launches --------------------------------------------------------------------------------


def device_facts(device: torch.device) -> tuple[int, int]:
    """(SMs, shared memory a block may opt into) the tiles are chosen for: the GPU's
    (``fit.limits``), or an H200's for the interpreter on the CPU."""
    limits = device_limits(device) or H200
    return limits.sm_count, limits.shared_optin_bytes


def _check_operands(
    a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, groups: int
) -> tuple[int, int, int]:
    """(M, N per group, K) after checking dtypes, shapes and contiguity."""
    for name, t in (("activation", a_q), ("weight", w_q)):
        if t.dtype != FP8_DTYPE:
            raise ValueError(f"the {name} must be {FP8_DTYPE}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"the {name}'s last dim must be contiguous")
    if a_s.dtype != torch.float32 or w_s.dtype != torch.float32:
        raise ValueError(f"scales must be float32, got {a_s.dtype} and {w_s.dtype}")
    if w_q.dim() != 2 or w_q.shape[0] % groups:
        raise ValueError(f"weight {tuple(w_q.shape)} is not [groups * N, K] for {groups} groups")
    n, k = w_q.shape[0] // groups, w_q.shape[1]
    m = a_q.shape[0]
    kb = triton.cdiv(k, FP8_SCALE_BLOCK)
    want_a = (m, k) if groups == 1 else (m, groups, k)
    if a_q.dim() != len(want_a) or a_q.shape[:-1] != want_a[:-1] or a_q.shape[-1] < k:
        raise ValueError(f"activation {tuple(a_q.shape)} does not fit {want_a} (weight K {k})")
    if tuple(a_s.shape) != (*want_a[:-1], kb):
        raise ValueError(f"activation scales {tuple(a_s.shape)} do not fit {tuple(a_q.shape)}")
    want_ws = (triton.cdiv(groups * n, FP8_SCALE_BLOCK), kb)
    if tuple(w_s.shape) != want_ws:
        raise ValueError(f"weight scales {tuple(w_s.shape)} do not fit weight {tuple(w_q.shape)}")
    return m, n, k


def _launch(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    *,
    groups: int,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    config: Fp8GemmConfig | None = None,
    quant_out: bool = False,
    eps: float = DEFAULT_EPS,
    keep_partials: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one launch behind the public entry points (their defaults): ``(out, scales)`` where
    ``quant_out`` makes ``out`` FP8 with its scales, else ``scales`` is None; with
    ``keep_partials`` ``(fp32 split-K partials [S, M, N], None)``."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    m, n, k = _check_operands(a_q, a_s, w_q, w_s, groups)
    n_total = groups * n
    if quant_out and n % FP8_SCALE_BLOCK:
        raise ValueError(f"quant_out needs N a multiple of {FP8_SCALE_BLOCK}, got {n}")
    num_sms, shared_limit = device_facts(a_q.device)
    if config is None:
        config = choose_config(
            m,
            n,
            k,
            groups=groups,
            num_sms=num_sms,
            shared_limit=shared_limit,
            quant_out=quant_out,
        )
    else:
        config = fit_to_shared(config, shared_limit)
    if quant_out and config.block_n != FP8_SCALE_BLOCK:
        raise ValueError(f"quant_out needs block_n {FP8_SCALE_BLOCK}, got {config}")

    dev = a_q.device
    scale_out: torch.Tensor | None = None
    if quant_out:
        out = torch.empty((m, n_total), dtype=FP8_DTYPE, device=dev) if out is None else out
        scale_out = empty_group_scales(m, n_total // FP8_SCALE_BLOCK, dev, mn_major=True)
    elif out is None:
        out = torch.empty((m, n_total), dtype=out_dtype, device=dev)
    if tuple(out.shape) != (m, n_total) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {n_total}] with contiguous rows")
    if m == 0 or n_total == 0:
        if keep_partials:
            return torch.zeros((1, m, n_total), dtype=torch.float32, device=dev), None
        return out, scale_out

    splits, k_per_split = split_blocks(k, config.block_k, config.split_k)
    per_split = k_per_split // config.block_k
    partial = None
    if splits > 1 or keep_partials:
        partial = torch.empty((splits, m, n_total), dtype=torch.float32, device=dev)
    a_strides = (a_q.stride(0), a_q.stride(1) if groups > 1 else 0)
    as_strides = (
        (a_s.stride(0), a_s.stride(1), a_s.stride(2))
        if groups > 1
        else (a_s.stride(0), 0, a_s.stride(1))
    )
    mode = _OUT_PARTIAL if partial is not None else (_OUT_QUANT if quant_out else _OUT_PLAIN)
    target = partial if partial is not None else out
    os_t = scale_out if scale_out is not None and partial is None else target
    grid = (
        triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),
        splits,
        groups,
    )
    _fp8_gemm_kernel[grid](
        a_q,
        a_s,
        w_q,
        w_s,
        target,
        os_t,
        m,
        n,
        k,
        per_split,
        *a_strides,
        *as_strides,
        w_q.stride(0),
        w_s.stride(0),
        w_s.stride(1),
        target.stride(0) if partial is not None else 0,
        target.stride(-2),
        os_t.stride(0) if mode == _OUT_QUANT else 0,
        os_t.stride(1) if mode == _OUT_QUANT else 0,
        eps,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        SWAP_AB=config.swap_ab,
        OUT_MODE=mode,
        ROUND=ROUND_CODES[out_dtype],
        SCALE_BLOCK=FP8_SCALE_BLOCK,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if keep_partials:
        assert partial is not None
        return partial, None
    if partial is not None:
        block = FP8_SCALE_BLOCK if quant_out else min(1024, triton.next_power_of_2(n_total))
        rmode = _OUT_QUANT if quant_out else _OUT_PLAIN
        os_r = scale_out if scale_out is not None else out
        _splitk_reduce_kernel[(m, triton.cdiv(n_total, block))](
            partial,
            out,
            os_r,
            n_total,
            splits,
            partial.stride(0),
            partial.stride(1),
            out.stride(0),
            os_r.stride(0) if quant_out else 0,
            os_r.stride(1) if quant_out else 0,
            eps,
            BLOCK_N=block,
            OUT_MODE=rmode,
            ROUND=ROUND_CODES[out_dtype],
            num_warps=4,
        )
    return out, scale_out


def fp8_block_gemm(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """``a_q [M, Kp]`` (FP8, ``Kp >= K``, zero past K) with ``a_s [M, ceil(K/128)]`` (fp32, any
    strides) times ``w_q [N, K]`` (FP8) with ``w_s [ceil(N/128), ceil(K/128)]`` -> ``[M, N]`` in
    ``out_dtype`` (bf16 or fp16), into ``out`` when given. ``config`` defaults to the table's
    tile for M (``fp8_gemm_config.choose_config``)."""
    y, _ = _launch(a_q, a_s, w_q, w_s, groups=1, out_dtype=out_dtype, out=out, config=config)
    return y


def fp8_grouped_gemm(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """Block-diagonal: ``a_q [M, G, Kp]``, ``a_s [M, G, ceil(K/128)]``, ``w_q [G * N, K]`` ->
    ``[M, G * N]``; group ``g``'s K values times W's rows ``g*N .. g*N+N-1``, one launch."""
    groups = a_q.shape[1] if a_q.dim() == 3 else 0
    if groups < 1:
        raise ValueError(f"grouped activation must be [M, G, K], got {tuple(a_q.shape)}")
    y, _ = _launch(a_q, a_s, w_q, w_s, groups=groups, out_dtype=out_dtype, out=out, config=config)
    return y


def fp8_gemm_partials(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    *,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """The plain GEMM's fp32 split-K partial sums ``[S, M, N]`` (``S = 1`` when the tile does not
    split K), left for a consumer that adds them in its own launch
    (``fused_quant.rms_norm_quant_fp8``: the reduction, the norm and the next GEMM's
    quantisation in one)."""
    partials, _ = _launch(a_q, a_s, w_q, w_s, groups=1, config=config, keep_partials=True)
    return partials


def fp8_gemm_quant_out(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    *,
    round_dtype: torch.dtype = torch.bfloat16,
    config: Fp8GemmConfig | None = None,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM (plain ``a_q [M, Kp]`` or grouped ``[M, G, Kp]``) with its output quantised for
    the next FP8 GEMM in the epilogue: ``(q [M, G*N] e4m3, scale [M, G*N/128] fp32,
    MN-major)``, equal to rounding the output to ``round_dtype`` and then
    ``per_token_group_quant_fp8``. N (per group) must be a multiple of 128."""
    groups = a_q.shape[1] if a_q.dim() == 3 else 1
    q, s = _launch(
        a_q,
        a_s,
        w_q,
        w_s,
        groups=groups,
        out_dtype=round_dtype,
        config=config,
        quant_out=True,
        eps=eps,
    )
    assert s is not None
    return q, s
