"""TileLang variant of the mHC pre and fused post+pre kernels (DeepSeek V4, hc = 4).

Same inputs, outputs and maths as the Triton kernels in ``mhc_triton.py`` (see ``mhc.py`` for the
formulas); the caller allocates ``out`` (the layer input, in the symmetric pool when enabled), and
this module allocates only ordinary tensors: post, comb, the new residual and the workspace.

Two kernels per call, no atomics (deterministic, CUDA-graph safe):

1. ``mix``: grid (token blocks, H splits), 128 threads. Each iteration stages one
   ``[BLOCK_T, 4 streams, 64]`` tile of the residual in shared memory as fp32 (optionally after
   applying the previous sublayer's post, whose new residual is stored rounded and mixed *as
   rounded*, exactly like an unfused post then pre) and the matching ``[24, 4*64]`` slice of ``fn``.
   Thread (warp w, lane m) then accumulates mix m of tokens w, w+4, ... with fp32 FMAs: fp32 keeps
   the mixes at ~1e-6 (a tf32 tensor-core GEMM would cost ~1e-3, too much for 20 Sinkhorn steps),
   and the work is small (24 x 4H FMAs per token). Lane 24, otherwise idle (24 mixes padded to 32
   lanes), squares the residual instead, so the sum of squares for the RMS rides along for free.
   The partial sums go to a ``[splits, T, 32]`` fp32 workspace (column 24 = sum of squares).
2. ``finalize``: one program per token. Sums the splits, takes the RMS, computes pre / post and the
   Sinkhorn comb (thread 0: a 4x4 matrix is too small to spread), then the pre-weighted stream sum
   and, when given, the fused RMSNorm of the *rounded* sum (as a separate norm would see it).

``T`` (tokens) and the split count are runtime sizes, so a kernel is compiled once per
(hidden size, dtype, fused?, tile config) or (hidden size, dtype, weight dtype, norm?) and reused
for every batch size: a compile takes seconds and decode batch sizes change every step.

``tilelang`` is imported only inside the builders, so importing this module never needs it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.fit.footprint import Footprint
from sglang.kernels.fit.limits import DeviceLimits
from sglang.kernels.ops.layernorm.mhc_params import MhcParams

HC = 4
NMIX = (2 + HC) * HC  # 24 mixes: pre(4) | post(4) | comb(16, row-major)
NMIX_PAD = 32  # one warp's lanes; lane 24 carries the sum of squares
SQ_COL = NMIX  # workspace column holding the partial sum of squares
BLOCK_D = 64  # H columns per stream per mix-kernel iteration
VEC = 4  # floats per shared-memory load in the mix loop
MIX_THREADS = 128  # 4 warps: warp w owns tokens w, w + 4, ... of the block
FIN_THREADS = 128
POST_MULT = 2.0

_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
}


def tilelang_supports(residual: torch.Tensor) -> bool:
    """Shapes and dtypes the kernels are written for (everything else takes another backend)."""
    return residual.dim() == 3 and residual.shape[1] == HC and residual.dtype in _DTYPES


def mix_footprint(block_t: int) -> Footprint:
    """One mix program: its ``alloc_shared`` buffers (fp32): the stream tile twice (mixed and
    raw), the padded ``fn`` slice, ``x``'s tile and each token's post and comb."""
    kd = HC * BLOCK_D
    floats = 2 * block_t * kd + NMIX_PAD * (kd + VEC) + block_t * BLOCK_D + block_t * (HC + HC * HC)
    return Footprint(4 * floats, MIX_THREADS // 32)


def mhc_tilelang_unfit_reason(residual: torch.Tensor, limits: DeviceLimits | None) -> str | None:
    """None when the TileLang kernels take ``residual`` here (hc = 4, a kernel dtype, the
    largest mix tile within the device's limits, the family on), else why not."""
    if not tilelang_supports(residual):
        return f"residual {tuple(residual.shape)} {residual.dtype}: the kernels take hc = {HC}"
    return unfit_reason("mhc_tilelang", mix_footprint(32), limits, what="TileLang mHC mix")


def mix_config(t: int, h: int) -> tuple[int, int]:
    """(BLOCK_T, CHUNK) for ``t`` tokens: three buckets, so only three mix kernels per (H, dtype,
    fused?) are ever compiled. Small T splits H finely so one token still fills the GPU; large T
    takes bigger token blocks (each re-reads its ``fn`` slice from L2 once) and fewer splits (a
    smaller workspace and a shorter sum in the finalize)."""
    if t <= 8:
        block_t, chunk = 4, BLOCK_D
    elif t <= 256:
        block_t, chunk = 16, 2 * BLOCK_D
    else:
        block_t, chunk = 32, 8 * BLOCK_D
    chunk = min(chunk, -(-h // BLOCK_D) * BLOCK_D)  # never more than H (rounded up to a tile)
    return block_t, chunk


# ----------------------------------------------------------------------------- kernel builders


def _prim_func(T: Any, body: Any, params: dict[str, Any]) -> Any:
    """``T.prim_func`` on a kernel body whose parameter types are given as objects.

    The kernel signatures carry their TileLang types here rather than as annotations: with
    ``from __future__ import annotations`` an annotation is a string, and TileLang evaluates it
    only against the names the body itself uses, so a size used only in a signature (``k_all``)
    would not resolve."""
    body.__annotations__ = dict(params)
    return T.prim_func(body)


def build_mix_kernel(h: int, dtype: str, fuse_post: bool, block_t: int, chunk: int) -> Any:
    """The split-over-H partial-mix kernel as a TileLang ``PrimFunc`` (not compiled)."""
    import tilelang.language as T

    if block_t % (MIX_THREADS // 32) or chunk % BLOCK_D:
        raise ValueError(f"bad mix config block_t={block_t} chunk={chunk}")
    n_warps = MIX_THREADS // 32
    tok_per_warp = block_t // n_warps
    n_tiles = chunk // BLOCK_D
    kd = HC * BLOCK_D  # one tile's columns, stream-major: k * BLOCK_D + d
    k_all = HC * h
    f32 = "float32"
    n_tok = T.dynamic("n_tok")
    n_split = T.dynamic("n_split")

    params = {
        "res": T.Tensor((n_tok, HC, h), dtype),
        "x": T.Tensor((n_tok, h), dtype),
        "post": T.Tensor((n_tok, HC), f32),
        "comb": T.Tensor((n_tok, HC, HC), f32),
        "new_res": T.Tensor((n_tok, HC, h), dtype),
        "fn": T.Tensor((NMIX, k_all), f32),
        "part": T.Tensor((n_split, n_tok, NMIX_PAD), f32),
    }

    def mhc_mix(res, x, post, comb, new_res, fn, part):  # type: ignore[no-untyped-def]
        with T.Kernel(T.ceildiv(n_tok, block_t), n_split, threads=MIX_THREADS) as (bt, bs):
            r_s = T.alloc_shared((block_t, kd), f32)
            # Rows padded by 4 floats: lane m reads 16 bytes of row m at once, and the padding puts
            # the 8 lanes of each quarter-warp on distinct banks while keeping rows 16-byte aligned.
            f_s = T.alloc_shared((NMIX_PAD, kd + VEC), f32)
            raw_s = T.alloc_shared((block_t, kd), f32)
            x_s = T.alloc_shared((block_t, BLOCK_D), f32)
            pc_s = T.alloc_shared((block_t, HC + HC * HC), f32)  # post | comb of each token
            acc = T.alloc_local((tok_per_warp,), f32)
            w_v = T.alloc_local((VEC,), f32)
            r_v = T.alloc_local((VEC,), f32)
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            for i in T.serial(tok_per_warp):
                acc[i] = 0.0
            if fuse_post:
                for t, j in T.Parallel(block_t, HC + HC * HC):
                    tok = bt * block_t + t
                    pc_s[t, j] = T.if_then_else(
                        tok < n_tok,
                        T.if_then_else(
                            j < HC, post[tok, j % HC], comb[tok, (j - HC) // HC, (j - HC) % HC]
                        ),
                        0.0,
                    )
            for it in T.serial(n_tiles):
                d0 = bs * chunk + it * BLOCK_D
                for m, c in T.Parallel(NMIX_PAD, kd):
                    col = d0 + c % BLOCK_D
                    f_s[m, c] = T.if_then_else(
                        (m < NMIX) & (col < h), fn[m, (c // BLOCK_D) * h + col], 0.0
                    )
                if fuse_post:
                    for t, c in T.Parallel(block_t, kd):
                        tok = bt * block_t + t
                        col = d0 + c % BLOCK_D
                        raw_s[t, c] = T.if_then_else(
                            (tok < n_tok) & (col < h),
                            T.cast(res[tok, c // BLOCK_D, col], f32),
                            0.0,
                        )
                    for t, d in T.Parallel(block_t, BLOCK_D):
                        tok = bt * block_t + t
                        x_s[t, d] = T.if_then_else(
                            (tok < n_tok) & (d0 + d < h), T.cast(x[tok, d0 + d], f32), 0.0
                        )
                    for t, c in T.Parallel(block_t, kd):
                        # New stream k = post_k * x + sum_j comb[j, k] * old stream j.
                        k = c // BLOCK_D
                        d = c % BLOCK_D
                        tok = bt * block_t + t
                        val = T.cast(
                            pc_s[t, k] * x_s[t, d]
                            + pc_s[t, HC + 0 * HC + k] * raw_s[t, 0 * BLOCK_D + d]
                            + pc_s[t, HC + 1 * HC + k] * raw_s[t, 1 * BLOCK_D + d]
                            + pc_s[t, HC + 2 * HC + k] * raw_s[t, 2 * BLOCK_D + d]
                            + pc_s[t, HC + 3 * HC + k] * raw_s[t, 3 * BLOCK_D + d],
                            dtype,
                        )
                        if (tok < n_tok) & (d0 + d < h):
                            new_res[tok, k, d0 + d] = val
                        # Mix the stored (rounded) value, as the unfused pre would read it back.
                        r_s[t, c] = T.cast(val, f32)
                else:
                    for t, c in T.Parallel(block_t, kd):
                        tok = bt * block_t + t
                        col = d0 + c % BLOCK_D
                        r_s[t, c] = T.if_then_else(
                            (tok < n_tok) & (col < h),
                            T.cast(res[tok, c // BLOCK_D, col], f32),
                            0.0,
                        )
                # 16-byte shared loads (VEC floats): the loop is bound by shared-memory loads, not
                # FMAs, so each load must feed several FMAs. r_s rows are warp-uniform broadcasts.
                for c0 in T.serial(kd // VEC):
                    for q in T.vectorized(VEC):
                        w_v[q] = f_s[lane, c0 * VEC + q]
                    for i in T.unroll(tok_per_warp):
                        for q in T.vectorized(VEC):
                            r_v[q] = r_s[warp + i * n_warps, c0 * VEC + q]
                        for q in T.unroll(VEC):
                            acc[i] += r_v[q] * T.if_then_else(lane == SQ_COL, r_v[q], w_v[q])
            for i in T.serial(tok_per_warp):
                tok = bt * block_t + warp + i * n_warps
                if (tok < n_tok) & (lane <= SQ_COL):
                    part[bs, tok, lane] = acc[i]

    return _prim_func(T, mhc_mix, params)


def build_finalize_kernel(h: int, dtype: str, w_dtype: str, has_norm: bool) -> Any:
    """The per-token finalize kernel as a TileLang ``PrimFunc`` (not compiled)."""
    import tilelang.language as T

    f32 = "float32"
    groups = FIN_THREADS // 32  # thread groups summing interleaved splits
    h_pad = -(-h // FIN_THREADS) * FIN_THREADS
    n_tok = T.dynamic("n_tok")
    n_split = T.dynamic("n_split")

    params = {
        "part": T.Tensor((n_split, n_tok, NMIX_PAD), f32),
        "src": T.Tensor((n_tok, HC, h), dtype),
        "scale": T.Tensor((3,), f32),
        "base": T.Tensor((NMIX,), f32),
        "norm_w": T.Tensor((h,), w_dtype),
        "out": T.Tensor((n_tok, h), dtype),
        "post": T.Tensor((n_tok, HC), f32),
        "comb": T.Tensor((n_tok, HC, HC), f32),
        "rms_eps": T.float32,
        "hc_eps": T.float32,
        "norm_eps": T.float32,
        "sinkhorn_iters": T.int32,
    }

    def mhc_finalize(  # type: ignore[no-untyped-def]
        part, src, scale, base, norm_w, out, post, comb, rms_eps, hc_eps, norm_eps, sinkhorn_iters
    ):
        with T.Kernel(n_tok, threads=FIN_THREADS) as tok:
            red_s = T.alloc_shared((groups, NMIX_PAD), f32)
            mix_s = T.alloc_shared((NMIX_PAD,), f32)
            pre_s = T.alloc_shared((HC,), f32)
            part_acc = T.alloc_local((1,), f32)
            c = T.alloc_local((HC * HC,), f32)
            sums = T.alloc_local((HC,), f32)
            sc = T.alloc_local((4,), f32)  # r, row max / sum scratch
            tx = T.get_thread_binding()
            lane = tx % 32
            grp = tx // 32
            part_acc[0] = 0.0
            for j in T.serial(T.ceildiv(n_split, groups)):
                s = j * groups + grp
                if (s < n_split) & (lane <= SQ_COL):
                    part_acc[0] += part[s, tok, lane]
            red_s[grp, lane] = part_acc[0]
            T.sync_threads()
            if tx < NMIX_PAD:
                mix_s[tx] = red_s[0, tx] + red_s[1, tx] + red_s[2, tx] + red_s[3, tx]
            T.sync_threads()
            if tx == 0:
                sc[0] = 1.0 / T.sqrt(mix_s[SQ_COL] / (HC * h) + rms_eps)
                for k in T.unroll(HC):
                    pre_s[k] = (
                        1.0 / (1.0 + T.exp(-(mix_s[k] * sc[0] * scale[0] + base[k]))) + hc_eps
                    )
                    post[tok, k] = POST_MULT / (
                        1.0 + T.exp(-(mix_s[HC + k] * sc[0] * scale[1] + base[HC + k]))
                    )
                for ij in T.unroll(HC * HC):
                    c[ij] = mix_s[2 * HC + ij] * sc[0] * scale[2] + base[2 * HC + ij]
                # Row softmax, + eps, then a column normalisation.
                for i in T.unroll(HC):
                    sc[1] = T.max(
                        T.max(c[i * HC], c[i * HC + 1]), T.max(c[i * HC + 2], c[i * HC + 3])
                    )
                    for j in T.unroll(HC):
                        c[i * HC + j] = T.exp(c[i * HC + j] - sc[1])
                    sc[2] = c[i * HC] + c[i * HC + 1] + c[i * HC + 2] + c[i * HC + 3]
                    for j in T.unroll(HC):
                        c[i * HC + j] = c[i * HC + j] / sc[2] + hc_eps
                for j in T.unroll(HC):
                    sums[j] = c[j] + c[HC + j] + c[2 * HC + j] + c[3 * HC + j] + hc_eps
                for i in T.unroll(HC):
                    for j in T.unroll(HC):
                        c[i * HC + j] = c[i * HC + j] / sums[j]
                # iters - 1 x (row, then column) normalisation.
                for _ in T.serial(sinkhorn_iters - 1):
                    for i in T.unroll(HC):
                        sums[i] = c[i * HC] + c[i * HC + 1] + c[i * HC + 2] + c[i * HC + 3] + hc_eps
                    for i in T.unroll(HC):
                        for j in T.unroll(HC):
                            c[i * HC + j] = c[i * HC + j] / sums[i]
                    for j in T.unroll(HC):
                        sums[j] = c[j] + c[HC + j] + c[2 * HC + j] + c[3 * HC + j] + hc_eps
                    for i in T.unroll(HC):
                        for j in T.unroll(HC):
                            c[i * HC + j] = c[i * HC + j] / sums[j]
                for i in T.unroll(HC):
                    for j in T.unroll(HC):
                        comb[tok, i, j] = c[i * HC + j]
            T.sync_threads()
            if has_norm:
                # Fragments padded to a whole number of elements per thread: TileLang's reduction
                # needs every thread to own a slice (H = 96 would leave threads empty).
                y_f = T.alloc_fragment((h_pad,), f32)
                sq_f = T.alloc_fragment((h_pad,), f32)
                tot_f = T.alloc_fragment((1,), f32)
                for d in T.Parallel(h_pad):
                    # The rounded sum: the norm sees what a separate RMSNorm would read back.
                    y_f[d] = T.if_then_else(
                        d < h,
                        T.cast(
                            T.cast(
                                pre_s[0] * T.cast(src[tok, 0, d], f32)
                                + pre_s[1] * T.cast(src[tok, 1, d], f32)
                                + pre_s[2] * T.cast(src[tok, 2, d], f32)
                                + pre_s[3] * T.cast(src[tok, 3, d], f32),
                                dtype,
                            ),
                            f32,
                        ),
                        0.0,
                    )
                for d in T.Parallel(h_pad):
                    sq_f[d] = y_f[d] * y_f[d]
                T.reduce_sum(sq_f, tot_f, dim=0)
                for d in T.Parallel(h_pad):
                    if d < h:
                        out[tok, d] = T.cast(
                            y_f[d]
                            * (1.0 / T.sqrt(tot_f[0] / h + norm_eps))
                            * T.cast(norm_w[d], f32),
                            dtype,
                        )
            else:
                for d in T.Parallel(h):
                    out[tok, d] = T.cast(
                        pre_s[0] * T.cast(src[tok, 0, d], f32)
                        + pre_s[1] * T.cast(src[tok, 1, d], f32)
                        + pre_s[2] * T.cast(src[tok, 2, d], f32)
                        + pre_s[3] * T.cast(src[tok, 3, d], f32),
                        dtype,
                    )

    return _prim_func(T, mhc_finalize, params)


# ----------------------------------------------------------------------------- compiled kernels


def _compile(prim: Any) -> Any:
    import tilelang

    # "auto" takes the current device's architecture; tvm_ffi launches on torch's current stream
    # (so the kernels can be captured in a CUDA graph).
    return tilelang.compile(prim, target="auto", execution_backend="tvm_ffi")


@functools.cache
def _mix_kernel(h: int, dtype: str, fuse_post: bool, block_t: int, chunk: int) -> Any:
    return _compile(build_mix_kernel(h, dtype, fuse_post, block_t, chunk))


@functools.cache
def _finalize_kernel(h: int, dtype: str, w_dtype: str, has_norm: bool) -> Any:
    return _compile(build_finalize_kernel(h, dtype, w_dtype, has_norm))


# ----------------------------------------------------------------------------- launchers

_ALIGN = 16  # bytes: the generated code loads and stores up to 16-byte vectors from each base


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 16-byte aligned; a copy only for an odd view (e.g. a sliced tensor),
    since TileLang's vectorised accesses assume the base is aligned and would fault otherwise."""
    t = t.contiguous()
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


def _launch(
    residual: torch.Tensor,
    fused: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    out: torch.Tensor,
    params: MhcParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mix + finalize; ``fused`` = (x, post_prev, comb_prev, new_residual) applies the previous
    post first. Returns (post, comb) of this pre."""
    t, hc, h = residual.shape
    dev = residual.device
    if t and (not out.is_contiguous() or out.data_ptr() % _ALIGN):
        # The caller's buffer cannot take vector stores: compute aside, then copy into it.
        tmp = torch.empty_like(out, memory_format=torch.contiguous_format)
        post, comb = _launch(
            residual,
            fused,
            fn,
            scale,
            base,
            tmp,
            params,
        )
        out.copy_(tmp)
        return post, comb
    post = torch.empty(t, hc, dtype=torch.float32, device=dev)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=dev)
    if t == 0:
        return post, comb
    residual = _aligned(residual)
    dtype = _DTYPES[residual.dtype]
    block_t, chunk = mix_config(t, h)
    n_split = -(-h // chunk)
    part = torch.empty(n_split, t, NMIX_PAD, dtype=torch.float32, device=dev)
    fn = _aligned(fn.float())
    if fused is None:
        # The unfused kernel never reads x / post / comb nor writes new_res; any tensor of the
        # declared shape and dtype satisfies the launcher's checks without an allocation.
        _mix_kernel(h, dtype, False, block_t, chunk)(residual, out, post, comb, residual, fn, part)
        src = residual
    else:
        x, post_prev, comb_prev, new_residual = fused
        _mix_kernel(h, dtype, True, block_t, chunk)(
            residual, _aligned(x), _aligned(post_prev), _aligned(comb_prev), new_residual, fn, part
        )
        src = new_residual
    norm_weight = params.norm_weight
    has_norm = norm_weight is not None
    if norm_weight is None:
        w = out[0]  # never read without the norm; any [H] tensor satisfies the launcher's checks
    else:
        w = _aligned(norm_weight if norm_weight.dtype in _DTYPES else norm_weight.float())
    _finalize_kernel(h, dtype, _DTYPES[w.dtype], has_norm)(
        part,
        src,
        _aligned(scale.float()),
        _aligned(base.float()),
        w,
        out,
        post,
        comb,
        float(params.rms_eps),
        float(params.hc_eps),
        float(params.norm_eps if params.norm_eps is not None else 0.0),
        int(params.sinkhorn_iters),
    )
    return post, comb


def mhc_pre_tilelang(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    out: torch.Tensor,
    params: MhcParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TileLang pre into ``out`` [T, H]; returns (post [T, hc], comb [T, hc, hc]) fp32."""
    return _launch(
        residual.contiguous(),
        None,
        fn,
        scale,
        base,
        out,
        params,
    )


def mhc_fused_post_pre_tilelang(
    residual: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    new_residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    out: torch.Tensor,
    params: MhcParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TileLang post (into ``new_residual``) + next pre (layer input into ``out``)
    -> (post_next, comb_next). Inputs as ``mhc.mhc_fused_post_pre`` prepares them: contiguous,
    post [T, hc] and comb [T, hc, hc] fp32 (the same arguments as
    ``mhc_triton.mhc_fused_post_pre_triton``)."""
    return _launch(
        residual,
        (x, post, comb, new_residual),
        fn,
        scale,
        base,
        out,
        params,
    )
