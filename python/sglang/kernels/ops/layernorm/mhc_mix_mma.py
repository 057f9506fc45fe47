"""The mHC mixes at prefill sizes on bf16 tensor cores (DeepSeek V4, hc = 4, bf16 residual).

The mixes ``R_flat @ fn^T`` ([T, 4H] x [4H, 24]) are a skinny GEMM whose cost is reading the
residual once. ``mhc_triton``'s split-over-H kernel converts every residual tile to fp32 for
tf32x3 dots and ran at ~0.4 TB/s at 8192 tokens on an H200 (714 us of an 821 us pre at H=4096).
Here the residual stays bf16 and is the MMA's A operand as loaded (a bf16 value is exact there),
and ``fn`` is split once per call into three bf16 pieces whose sum is ``fn`` to fp32 precision:
``hi = bf16(fn)``, ``mid = bf16(fn - hi)``, ``lo = bf16(fn - hi - mid)``. The pieces are stacked
along N (``PIECES`` groups of ``NMIX_PAD`` lanes, padded with zero rows to ``W_ROWS``), so one
bf16 MMA per tile forms all three products, each exact in its fp32 accumulator; the lane groups
are summed after the K loop. Residual, x and the new residual move through tensor descriptors
(TMA); out-of-range token rows read as zeros and are not stored.

The kernel writes the same partials as ``mhc_triton._mix_partial_kernel`` (``part`` [splits, T,
NMIX_PAD] and ``sq`` [splits, T]), so ``mhc_triton``'s finalize takes them unchanged; with
``FUSE_POST`` it first applies the previous sublayer's post and mixes the stored (rounded) new
residual, as the unfused post then pre would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.kernels.ops.layernorm.mhc_tilelang import NMIX_PAD

try:  # Triton is optional: without it only mhc.py's torch backend runs
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from sglang.kernels.ops.interp_dot import dot
    from sglang.kernels.ops.layernorm.mhc_post_stream import post_stream
    from sglang.kernels.ops.split_plan import split_blocks
    from sglang.kernels.ops.triton_dispatch import interpreter_enabled

    HAS_TRITON = True
except ImportError:  # pragma: no cover - Triton missing
    HAS_TRITON = False

PIECES = 3  # bf16 pieces of fn: 3 x 8 mantissa bits cover fp32's 24
W_ROWS = 128  # PIECES * NMIX_PAD lanes, rounded up to a power of two (the extra rows are zero)


@dataclass(frozen=True)
class MixMmaConfig:
    """Tile of the mix kernel: ``block_t`` tokens by ``block_d`` columns of each stream."""

    block_t: int
    block_d: int
    num_warps: int
    num_stages: int
    shared_bytes: int  # what a program takes (the sm_90 compiler, Triton 3.6 and 3.9)


# 128 token rows keep the weight tile's L2 traffic (W_ROWS rows a step) at the residual's. Both
# ops take the same tile and so the same splits and summation order: fused post+pre equals post
# then pre bit for bit, as on the split kernel. 32 columns a step because the fused post holds
# four fp32 stream tiles and x as well: at 64 it spills 892 bytes and asks for 234 KB of shared
# memory, over Hopper's 227 (sm_90 compile on the CPU, Triton 3.9, sglang.test.sm90_compile);
# the pre alone measured 3-4% faster at 64 (docs/performance.md).
PRE_CONFIG = MixMmaConfig(block_t=128, block_d=32, num_warps=8, num_stages=3, shared_bytes=164032)
FUSED_CONFIG = MixMmaConfig(block_t=128, block_d=32, num_warps=8, num_stages=2, shared_bytes=125064)
_TARGET_PROGRAMS = 264  # two per SM on an H200


if HAS_TRITON:

    @triton.jit
    def _split_fn_kernel(
        fn_ptr, w_ptr, K, NMIX: tl.constexpr, LANES: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        # w [W_ROWS, K] bf16: rows [p*LANES, p*LANES + NMIX) hold piece p of fn, the rest zero.
        offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        lane = tl.arange(0, LANES)
        mask_k = offs_k < K
        f = tl.load(
            fn_ptr + lane[:, None] * K + offs_k[None, :],
            mask=(lane < NMIX)[:, None] & mask_k[None, :],
            other=0.0,
        )
        hi = f.to(tl.bfloat16)
        rest = f - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        ptrs = w_ptr + lane[:, None].to(tl.int64) * K + offs_k[None, :]
        stride = LANES * K
        tl.store(ptrs, hi, mask=mask_k[None, :])
        tl.store(ptrs + stride, mid, mask=mask_k[None, :])
        tl.store(ptrs + 2 * stride, lo, mask=mask_k[None, :])
        tl.store(ptrs + 3 * stride, tl.zeros_like(hi), mask=mask_k[None, :])

    @triton.jit
    def _piece_dot(acc, r, w_desc, col, DOT_F32: tl.constexpr):
        # acc[t, p*LANES + m] += sum_d r[t, d] * piece_p(fn)[m, col + d]
        return dot(r, w_desc.load([0, col]).T, acc, DOT_F32)

    @triton.jit
    def _sq(r):
        f = r.to(tl.float32)
        return tl.sum(f * f, axis=1)

    @triton.jit
    def _mix_mma_kernel(
        res_desc,
        x_desc,
        new_res_desc,
        post_ptr,
        comb_ptr,
        w_desc,
        part_ptr,
        sq_ptr,
        T,
        H,
        CHUNK,
        FUSE_POST: tl.constexpr,
        NMIX_PAD: tl.constexpr,
        W_ROWS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        pid_s = tl.program_id(1)
        t0 = pid_t * BLOCK_T
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        acc = tl.zeros([BLOCK_T, W_ROWS], dtype=tl.float32)
        sq = tl.zeros([BLOCK_T], dtype=tl.float32)
        d_start = pid_s * CHUNK
        for d0 in range(d_start, tl.minimum(d_start + CHUNK, H), BLOCK_D):
            r0 = res_desc.load([t0, d0])
            r1 = res_desc.load([t0, H + d0])
            r2 = res_desc.load([t0, 2 * H + d0])
            r3 = res_desc.load([t0, 3 * H + d0])
            if FUSE_POST:
                xv = x_desc.load([t0, d0]).to(tl.float32)
                f0 = r0.to(tl.float32)
                f1 = r1.to(tl.float32)
                f2 = r2.to(tl.float32)
                f3 = r3.to(tl.float32)
                ty = r0.dtype
                r0 = post_stream(xv, f0, f1, f2, f3, post_ptr, comb_ptr, offs_t, mask_t, 0).to(ty)
                r1 = post_stream(xv, f0, f1, f2, f3, post_ptr, comb_ptr, offs_t, mask_t, 1).to(ty)
                r2 = post_stream(xv, f0, f1, f2, f3, post_ptr, comb_ptr, offs_t, mask_t, 2).to(ty)
                r3 = post_stream(xv, f0, f1, f2, f3, post_ptr, comb_ptr, offs_t, mask_t, 3).to(ty)
                new_res_desc.store([t0, d0], r0)
                new_res_desc.store([t0, H + d0], r1)
                new_res_desc.store([t0, 2 * H + d0], r2)
                new_res_desc.store([t0, 3 * H + d0], r3)
            # The stored (rounded) values are what gets mixed, as an unfused pre reads them back.
            acc = _piece_dot(acc, r0, w_desc, d0, DOT_F32)
            acc = _piece_dot(acc, r1, w_desc, H + d0, DOT_F32)
            acc = _piece_dot(acc, r2, w_desc, 2 * H + d0, DOT_F32)
            acc = _piece_dot(acc, r3, w_desc, 3 * H + d0, DOT_F32)
            sq += _sq(r0) + _sq(r1) + _sq(r2) + _sq(r3)
        mixes = tl.sum(tl.reshape(acc, (BLOCK_T, W_ROWS // NMIX_PAD, NMIX_PAD)), axis=1)
        out_row = (pid_s * T + offs_t).to(tl.int64)
        lanes = tl.arange(0, NMIX_PAD)
        tl.store(
            part_ptr + out_row[:, None] * NMIX_PAD + lanes[None, :], mixes, mask=mask_t[:, None]
        )
        tl.store(sq_ptr + out_row, sq, mask=mask_t)


def mix_mma_supports(residual: torch.Tensor, fused: bool) -> str:
    """Why the bf16-MMA mix kernel cannot take ``residual`` ('' when it can)."""
    if not HAS_TRITON:
        return "triton does not import"
    if residual.dtype != torch.bfloat16:
        return f"the residual is {residual.dtype}, the pieces need bf16"
    cfg = FUSED_CONFIG if fused else PRE_CONFIG
    h = residual.shape[-1]
    if h % cfg.block_d:
        return f"H={h} is not a multiple of the {cfg.block_d}-column step"
    return ""


def split_fn_pieces(fn: torch.Tensor) -> torch.Tensor:
    """``fn`` [NMIX, K] fp32 -> [W_ROWS, K] bf16: its three bf16 pieces, NMIX_PAD rows apart."""
    n_mix, k = fn.shape
    w = torch.empty(W_ROWS, k, dtype=torch.bfloat16, device=fn.device)
    block_k = 256
    _split_fn_kernel[(triton.cdiv(k, block_k),)](
        fn, w, k, NMIX=n_mix, LANES=NMIX_PAD, BLOCK_K=block_k, num_warps=4
    )
    return w


def mix_partials_mma(
    residual: torch.Tensor,
    x: torch.Tensor | None,
    post_prev: torch.Tensor | None,
    comb_prev: torch.Tensor | None,
    new_residual: torch.Tensor | None,
    fn: torch.Tensor,
    config: MixMmaConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(part [splits, T, NMIX_PAD], sq [splits, T])`` of contiguous ``residual`` [T, 4, H] bf16
    and fp32 ``fn`` [NMIX, 4H]; with ``x`` (and the previous post / comb), the post is applied
    first and written to ``new_residual``, whose values are then the ones mixed."""
    t, hc, h = residual.shape
    fused = x is not None
    cfg = config or (FUSED_CONFIG if fused else PRE_CONFIG)
    w = split_fn_pieces(fn)
    n_tb = triton.cdiv(t, cfg.block_t)
    n_splits, chunk = split_blocks(h, cfg.block_d, triton.cdiv(_TARGET_PROGRAMS, n_tb))
    part = torch.empty(n_splits, t, NMIX_PAD, dtype=torch.float32, device=residual.device)
    sq = torch.empty(n_splits, t, dtype=torch.float32, device=residual.device)
    block = [cfg.block_t, cfg.block_d]
    res_desc = TensorDescriptor.from_tensor(residual.view(t, hc * h), block)
    if fused:
        assert x is not None and new_residual is not None
        x_desc = TensorDescriptor.from_tensor(x, block)
        new_desc = TensorDescriptor.from_tensor(new_residual.view(t, hc * h), block)
    else:
        x_desc = new_desc = res_desc
    _mix_mma_kernel[(n_tb, n_splits)](
        res_desc,
        x_desc,
        new_desc,
        post_prev if fused else fn,
        comb_prev if fused else fn,
        TensorDescriptor.from_tensor(w, [W_ROWS, cfg.block_d]),
        part,
        sq,
        t,
        h,
        chunk,
        FUSE_POST=fused,
        NMIX_PAD=NMIX_PAD,
        W_ROWS=W_ROWS,
        BLOCK_T=cfg.block_t,
        BLOCK_D=cfg.block_d,
        DOT_F32=interpreter_enabled(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return part, sq
