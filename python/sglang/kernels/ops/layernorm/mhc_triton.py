"""Triton variant of the mHC pre, post and fused post+pre kernels (DeepSeek V4, hc = 4).

Same inputs, outputs and maths as the torch reference in ``mhc.py`` (see its docstring for the
formulas); the caller allocates ``out`` (the layer input), and this module allocates only
ordinary tensors: post, comb, the new residual and the workspace.

Two kernels per call, no atomics (deterministic, graph-safe; the split count depends on T only):
 1. ``_mix_partial_kernel``, grid (token blocks, H splits): for its [BLOCK_T tokens, H chunk]
    tile it optionally applies the previous sublayer's post (writing the new residual, rounded to
    its dtype, and mixing *that* rounded value, exactly as an unfused post then pre would), then
    accumulates the partial ``R_flat @ fn^T`` (tf32x3 tensor-core dot, ~fp32 accuracy) and the
    partial sum of squares. Splitting over H gives enough programs at decode sizes (T = 1
    still fills the GPU); ``fn`` ([24, 4H] fp32, 2.75 MB at H = 7168) is read once per token
    block and stays in L2.
 2. ``_pre_finalize_kernel``, one program per token: sums the splits, takes the RMS, computes
    pre / post / Sinkhorn comb on a 4x4 tile, then the weighted stream sum (and fused RMSNorm).
The kernels are written for hc = 4 (DeepSeek V4's hc_mult); mhc.py's entry points refuse
anything else (``_checked_backend``, with mhc_tilelang.tilelang_supports): other hc values run on
torch.
"""

from __future__ import annotations

import torch

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.fit.footprint import Footprint
from sglang.kernels.fit.limits import DeviceLimits
from sglang.kernels.ops.layernorm import mhc_mix_mma
from sglang.kernels.ops.layernorm.mhc_params import MhcParams
from sglang.kernels.ops.layernorm.mhc_tilelang import NMIX_PAD

try:  # Triton is optional: without it only mhc.py's torch backend runs
    import triton
    import triton.language as tl

    from sglang.kernels.ops.layernorm.mhc_post_stream import post_stream
    from sglang.kernels.ops.split_plan import split_blocks

    HAS_TRITON = True
except ImportError:  # pragma: no cover - Triton missing
    HAS_TRITON = False


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("the triton mHC backend was asked for, but triton does not import")


if HAS_TRITON:

    @triton.jit
    def _mix_dot(
        acc,
        r,
        fn_ptr,
        offs_d,
        mask_d,
        offs_m,
        mask_m,
        K,
        S: tl.constexpr,
        H,
        PRECISION: tl.constexpr,
    ):
        # acc[t, m] += sum_d r[t, d] * fn[m, S*H + d]
        w = tl.load(
            fn_ptr + offs_m[None, :] * K + S * H + offs_d[:, None],
            mask=mask_d[:, None] & mask_m[None, :],
            other=0.0,
        ).to(tl.float32)
        return tl.dot(r, w, acc, input_precision=PRECISION)

    @triton.jit
    def _mix_partial_kernel(
        res_ptr,
        x_ptr,
        post_ptr,
        comb_ptr,
        new_res_ptr,
        fn_ptr,
        part_ptr,
        sq_ptr,
        T,
        H,
        CHUNK,
        FUSE_POST: tl.constexpr,
        NMIX: tl.constexpr,
        NMIX_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        pid_s = tl.program_id(1)
        K = 4 * H
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        offs_m = tl.arange(0, NMIX_PAD)
        mask_m = offs_m < NMIX
        row = offs_t.to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_T, NMIX_PAD], dtype=tl.float32)
        sq = tl.zeros([BLOCK_T], dtype=tl.float32)
        d_start = pid_s * CHUNK
        for d0 in range(d_start, d_start + CHUNK, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < H
            m2 = mask_t[:, None] & mask_d[None, :]
            ptrs = row + offs_d[None, :]
            r0 = tl.load(res_ptr + ptrs, mask=m2, other=0.0).to(tl.float32)
            r1 = tl.load(res_ptr + ptrs + H, mask=m2, other=0.0).to(tl.float32)
            r2 = tl.load(res_ptr + ptrs + 2 * H, mask=m2, other=0.0).to(tl.float32)
            r3 = tl.load(res_ptr + ptrs + 3 * H, mask=m2, other=0.0).to(tl.float32)
            if FUSE_POST:
                out_ty = new_res_ptr.dtype.element_ty
                xv = tl.load(
                    x_ptr + offs_t.to(tl.int64)[:, None] * H + offs_d[None, :], mask=m2, other=0.0
                )
                xv = xv.to(tl.float32)
                n0 = post_stream(xv, r0, r1, r2, r3, post_ptr, comb_ptr, offs_t, mask_t, 0).to(
                    out_ty
                )
                n1 = post_stream(xv, r0, r1, r2, r3, post_ptr, comb_ptr, offs_t, mask_t, 1).to(
                    out_ty
                )
                n2 = post_stream(xv, r0, r1, r2, r3, post_ptr, comb_ptr, offs_t, mask_t, 2).to(
                    out_ty
                )
                n3 = post_stream(xv, r0, r1, r2, r3, post_ptr, comb_ptr, offs_t, mask_t, 3).to(
                    out_ty
                )
                tl.store(new_res_ptr + ptrs, n0, mask=m2)
                tl.store(new_res_ptr + ptrs + H, n1, mask=m2)
                tl.store(new_res_ptr + ptrs + 2 * H, n2, mask=m2)
                tl.store(new_res_ptr + ptrs + 3 * H, n3, mask=m2)
                # Mix the stored (rounded) values, as the unfused pre would read them back.
                r0 = n0.to(tl.float32)
                r1 = n1.to(tl.float32)
                r2 = n2.to(tl.float32)
                r3 = n3.to(tl.float32)
            acc = _mix_dot(acc, r0, fn_ptr, offs_d, mask_d, offs_m, mask_m, K, 0, H, PRECISION)
            acc = _mix_dot(acc, r1, fn_ptr, offs_d, mask_d, offs_m, mask_m, K, 1, H, PRECISION)
            acc = _mix_dot(acc, r2, fn_ptr, offs_d, mask_d, offs_m, mask_m, K, 2, H, PRECISION)
            acc = _mix_dot(acc, r3, fn_ptr, offs_d, mask_d, offs_m, mask_m, K, 3, H, PRECISION)
            sq += tl.sum(r0 * r0 + r1 * r1 + r2 * r2 + r3 * r3, axis=1)
        out_row = (pid_s * T + offs_t).to(tl.int64)
        tl.store(
            part_ptr + out_row[:, None] * NMIX_PAD + offs_m[None, :], acc, mask=mask_t[:, None]
        )
        tl.store(sq_ptr + out_row, sq, mask=mask_t)

    @triton.jit
    def _pre_finalize_kernel(
        part_ptr,
        sq_ptr,
        res_ptr,
        scale_ptr,
        base_ptr,
        norm_w_ptr,
        out_ptr,
        post_ptr,
        comb_ptr,
        T,
        H,
        n_splits,
        rms_eps,
        hc_eps,
        norm_eps,
        sinkhorn_iters,
        HAS_NORM: tl.constexpr,
        NMIX_PAD: tl.constexpr,
        SPLIT_BLOCK: tl.constexpr,
        BLOCK_H: tl.constexpr,
        ONE_PASS: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, 4)
        ij = i[:, None] * 4 + i[None, :]
        pre_m = tl.zeros([4], dtype=tl.float32)
        post_m = tl.zeros([4], dtype=tl.float32)
        comb_m = tl.zeros([4, 4], dtype=tl.float32)
        ss = tl.zeros([1], dtype=tl.float32)
        # Sum the partials a tile of splits at a time (a serial per-split loop is latency bound).
        sp = tl.arange(0, SPLIT_BLOCK)
        for s0 in range(0, n_splits, SPLIT_BLOCK):
            srow = s0 + sp
            smask = srow < n_splits
            rows = (srow.to(tl.int64) * T + t) * NMIX_PAD
            pre_m += tl.sum(
                tl.load(part_ptr + rows[:, None] + i[None, :], mask=smask[:, None], other=0.0),
                axis=0,
            )
            post_m += tl.sum(
                tl.load(part_ptr + rows[:, None] + 4 + i[None, :], mask=smask[:, None], other=0.0),
                axis=0,
            )
            comb_m += tl.sum(
                tl.load(
                    part_ptr + rows[:, None, None] + 8 + ij[None, :, :],
                    mask=smask[:, None, None],
                    other=0.0,
                ),
                axis=0,
            )
            ss += tl.sum(tl.load(sq_ptr + srow.to(tl.int64) * T + t, mask=smask, other=0.0), axis=0)
        r = tl.sum(1.0 / tl.sqrt(ss / (4 * H) + rms_eps), axis=0)  # scalar
        sc_pre = tl.load(scale_ptr)
        sc_post = tl.load(scale_ptr + 1)
        sc_comb = tl.load(scale_ptr + 2)
        pre = tl.sigmoid(pre_m * r * sc_pre + tl.load(base_ptr + i)) + hc_eps
        post = 2.0 * tl.sigmoid(post_m * r * sc_post + tl.load(base_ptr + 4 + i))
        c = comb_m * r * sc_comb + tl.load(base_ptr + 8 + ij)
        c = tl.exp(c - tl.max(c, axis=1)[:, None])
        c = c / tl.sum(c, axis=1)[:, None] + hc_eps
        c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        for _ in range(sinkhorn_iters - 1):
            c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
            c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        tl.store(post_ptr + t * 4 + i, post)
        tl.store(comb_ptr + t * 16 + ij, c)

        out_ty = out_ptr.dtype.element_ty
        if ONE_PASS:
            # The whole row in registers: every load in flight at once and no re-read for the
            # norm (a token's row is 4*H values; BLOCK_H >= H).
            offs = tl.arange(0, BLOCK_H)
            mask = offs < H
            rb = tl.load(
                res_ptr + t * 4 * H + i[:, None] * H + offs[None, :], mask=mask[None, :], other=0.0
            )
            y = tl.sum(pre[:, None] * rb.to(tl.float32), axis=0).to(out_ty)
            if HAS_NORM:
                # RMSNorm of the rounded sum, like a separate norm would see it.
                yf = y.to(tl.float32)
                rn = 1.0 / tl.sqrt(tl.sum(yf * yf, axis=0) / H + norm_eps)
                w = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                y = (yf * rn * w).to(out_ty)
            tl.store(out_ptr + t * H + offs, y, mask=mask)
        else:
            ysq = tl.zeros([BLOCK_H], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                offs = h0 + tl.arange(0, BLOCK_H)
                mask = offs < H
                rb = tl.load(
                    res_ptr + t * 4 * H + i[:, None] * H + offs[None, :],
                    mask=mask[None, :],
                    other=0.0,
                )
                y = tl.sum(pre[:, None] * rb.to(tl.float32), axis=0).to(out_ty)
                tl.store(out_ptr + t * H + offs, y, mask=mask)
                if HAS_NORM:
                    yf = y.to(tl.float32)
                    ysq += yf * yf
            if HAS_NORM:
                # RMSNorm of the stored (rounded) sum, like a separate norm would see it; the second
                # pass re-reads this program's own stores, hence the barrier.
                rn = 1.0 / tl.sqrt(tl.sum(ysq, axis=0) / H + norm_eps)
                tl.debug_barrier()
                for h0 in range(0, H, BLOCK_H):
                    offs = h0 + tl.arange(0, BLOCK_H)
                    mask = offs < H
                    y = tl.load(out_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
                    w = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                    tl.store(out_ptr + t * H + offs, (y * rn * w).to(out_ty), mask=mask)

    @triton.jit
    def _post_kernel(
        res_ptr,
        x_ptr,
        post_ptr,
        comb_ptr,
        new_res_ptr,
        T,
        H,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_t = offs_t < T
        m2 = mask_t[:, None] & (offs_d < H)[None, :]
        ptrs = offs_t.to(tl.int64)[:, None] * (4 * H) + offs_d[None, :]
        r0 = tl.load(res_ptr + ptrs, mask=m2, other=0.0).to(tl.float32)
        r1 = tl.load(res_ptr + ptrs + H, mask=m2, other=0.0).to(tl.float32)
        r2 = tl.load(res_ptr + ptrs + 2 * H, mask=m2, other=0.0).to(tl.float32)
        r3 = tl.load(res_ptr + ptrs + 3 * H, mask=m2, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + offs_t.to(tl.int64)[:, None] * H + offs_d[None, :], mask=m2, other=0.0)
        xv = xv.to(tl.float32)
        out_ty = new_res_ptr.dtype.element_ty
        tl.store(
            new_res_ptr + ptrs,
            post_stream(xv, r0, r1, r2, r3, post_ptr, comb_ptr, offs_t, mask_t, 0).to(out_ty),
            mask=m2,
        )
        tl.store(
            new_res_ptr + ptrs + H,
            post_stream(xv, r0, r1, r2, r3, post_ptr, comb_ptr, offs_t, mask_t, 1).to(out_ty),
            mask=m2,
        )
        tl.store(
            new_res_ptr + ptrs + 2 * H,
            post_stream(xv, r0, r1, r2, r3, post_ptr, comb_ptr, offs_t, mask_t, 2).to(out_ty),
            mask=m2,
        )
        tl.store(
            new_res_ptr + ptrs + 3 * H,
            post_stream(xv, r0, r1, r2, r3, post_ptr, comb_ptr, offs_t, mask_t, 3).to(out_ty),
            mask=m2,
        )


# From this many tokens the mixes run on bf16 tensor cores (mhc_mix_mma): 1.03-1.21x at 256,
# 2.5-3.2x at 8192; at 128 its pre measured 0.88x, so smaller batches keep the split kernel's
# tf32x3 dots (H200, scripts/bench_mhc_mix.py; docs/performance.md "mHC").
MMA_MIN_T = 256
_ONE_PASS_MAX_H = 8192
_ONE_PASS_MAX_T = 256
_TARGET_PROGRAMS = 256  # ~2 per SM on an H200: enough splits that small T still fills the GPU


def _partial_config(t: int, h: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps, CHUNK, n_splits) for the split-over-H mix kernel.

    Bigger token blocks for bigger T cut the number of times ``fn`` is re-read from L2."""
    if t <= 256:
        block_t, block_d, warps = _PARTIAL_BLOCKS[0]
    elif t <= 2048:
        block_t, block_d, warps = _PARTIAL_BLOCKS[1]
    else:
        block_t, block_d, warps = _PARTIAL_BLOCKS[2]
    want = triton.cdiv(_TARGET_PROGRAMS, triton.cdiv(t, block_t))
    n_splits, chunk = split_blocks(h, block_d, want)
    return block_t, block_d, warps, chunk, n_splits


_PARTIAL_BLOCKS = ((16, 64, 4), (32, 64, 4), (64, 64, 8))  # _partial_config's tiles, by T


def partial_footprint(
    block_t: int, block_d: int, num_warps: int, elem_bytes: int, hc: int, fused: bool
) -> Footprint:
    """One program of the split mix kernel (the sm_90 compiler's numbers as a formula): the fp32
    ``fn`` chunk ``[NMIX_PAD, hc * block_d]``, and per token row its ``hc`` stream tiles in fp32
    (plus the loaded half-precision copy), with the fused post also the row of ``x``, its post
    and comb, and (fp32) the new streams."""
    per_row = hc * block_d * (4 + (elem_bytes if elem_bytes < 4 else 0))
    if fused:
        per_row += block_d * elem_bytes + (hc * hc + hc) * 4
        per_row += hc * block_d * 4 if elem_bytes == 4 else 0
    return Footprint(NMIX_PAD * hc * block_d * 4 + block_t * per_row, num_warps)


def mhc_triton_unfit_reason(dtype: torch.dtype, hc: int, limits: DeviceLimits | None) -> str | None:
    """None when every Triton mHC kernel a ``dtype`` residual of ``hc`` streams may take (the
    split mix at each token-count tile, fused or not, and at bf16 the tensor-core mixes) fits
    here and the family is on, else why not."""
    elem = torch.empty((), dtype=dtype).element_size()
    for block_t, block_d, warps in _PARTIAL_BLOCKS:
        for fused in (False, True):
            fp = partial_footprint(block_t, block_d, warps, elem, hc, fused)
            why = unfit_reason("mhc_triton", fp, limits, what=f"mHC mix tile {block_t} tokens")
            if why is not None:
                return why
    if dtype == torch.bfloat16:
        for cfg in (mhc_mix_mma.PRE_CONFIG, mhc_mix_mma.FUSED_CONFIG):
            fp = Footprint(cfg.shared_bytes, cfg.num_warps)
            why = unfit_reason("mhc_triton", fp, limits, what=f"mHC tensor-core mix {cfg}")
            if why is not None:
                return why
    return unfit_reason("mhc_triton")


def _dot_precision(device: torch.device) -> str:
    # tf32x3: three tf32 MMAs, ~fp32 accuracy (plain tf32 would cost ~1e-3 in the mixes).
    return "tf32x3" if device.type == "cuda" else "ieee"


def _mix_partials(
    residual: torch.Tensor,
    x: torch.Tensor | None,
    post_prev: torch.Tensor | None,
    comb_prev: torch.Tensor | None,
    new_residual: torch.Tensor | None,
    fn: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-over-H mix kernel (tf32x3 dots): ``(part, sq)`` for the finalize."""
    t, hc, h = residual.shape
    dev = residual.device
    fuse = x is not None
    block_t, block_d, warps, chunk, n_splits = _partial_config(t, h)
    part = torch.empty(n_splits, t, NMIX_PAD, dtype=torch.float32, device=dev)
    sq = torch.empty(n_splits, t, dtype=torch.float32, device=dev)
    _mix_partial_kernel[(triton.cdiv(t, block_t), n_splits)](
        residual,
        x if fuse else residual,
        post_prev if fuse else fn,
        comb_prev if fuse else fn,
        new_residual if fuse else residual,
        fn,
        part,
        sq,
        t,
        h,
        chunk,
        FUSE_POST=fuse,
        NMIX=(2 + hc) * hc,
        NMIX_PAD=NMIX_PAD,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        PRECISION=_dot_precision(dev),
        num_warps=warps,
        num_stages=2,  # the H loop is short at decode sizes; 3 stages would double shared memory
    )
    return part, sq


def mhc_fused_post_pre_triton(
    residual: torch.Tensor,
    x: torch.Tensor | None,
    post_prev: torch.Tensor | None,
    comb_prev: torch.Tensor | None,
    new_residual: torch.Tensor | None,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    out: torch.Tensor,
    params: MhcParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    _require_triton()
    t, hc, h = residual.shape
    dev = residual.device
    post = torch.empty(t, hc, dtype=torch.float32, device=dev)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=dev)
    if t == 0:
        return post, comb
    fuse = x is not None
    fn = fn.float().contiguous()
    if t >= MMA_MIN_T and not mhc_mix_mma.mix_mma_supports(residual, fuse):
        part, sq = mhc_mix_mma.mix_partials_mma(residual, x, post_prev, comb_prev, new_residual, fn)
    else:
        part, sq = _mix_partials(residual, x, post_prev, comb_prev, new_residual, fn)
    n_splits = part.shape[0]
    src = new_residual if fuse else residual
    has_norm = params.norm_weight is not None
    # Decode-sized batches finalise each row in registers in one pass (enough warps to keep about
    # 64 fp32 values a thread), which measured faster there on an H200; from T = 512 the 4-warp
    # loop over 1024-wide blocks measured faster (more programs resident), and it takes rows
    # wider than _ONE_PASS_MAX_H (numbers: docs/performance.md "mHC").
    one_pass = h <= _ONE_PASS_MAX_H and t <= _ONE_PASS_MAX_T
    block_h = triton.next_power_of_2(h) if one_pass else 1024
    _pre_finalize_kernel[(t,)](
        part,
        sq,
        src,
        scale.float().contiguous(),
        base.float().contiguous(),
        params.norm_weight.contiguous() if params.norm_weight is not None else fn,
        out,
        post,
        comb,
        t,
        h,
        n_splits,
        float(params.rms_eps),
        float(params.hc_eps),
        float(params.norm_eps if params.norm_eps is not None and has_norm else 0.0),
        int(params.sinkhorn_iters),
        HAS_NORM=has_norm,
        NMIX_PAD=NMIX_PAD,
        SPLIT_BLOCK=min(32, max(2, triton.next_power_of_2(n_splits))),
        BLOCK_H=block_h,
        ONE_PASS=one_pass,
        num_warps=max(4, min(16, block_h // 512)) if one_pass else 4,
    )
    return post, comb


def mhc_pre_triton(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    out: torch.Tensor,
    params: MhcParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton pre into ``out`` [T, H]; returns (post, comb)."""
    return mhc_fused_post_pre_triton(
        residual.contiguous(),
        None,
        None,
        None,
        None,
        fn,
        scale,
        base,
        out,
        params,
    )


def mhc_post_triton(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Triton post -> new residual."""
    _require_triton()
    residual = residual.contiguous()
    t, hc, h = residual.shape
    new_residual = torch.empty_like(residual)
    if t == 0:
        return new_residual
    block_t, block_d = 4, 512
    _post_kernel[(triton.cdiv(t, block_t), triton.cdiv(h, block_d))](
        residual,
        x.contiguous(),
        post.reshape(t, hc).float().contiguous(),
        comb.reshape(t, hc, hc).float().contiguous(),
        new_residual,
        t,
        h,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return new_residual
