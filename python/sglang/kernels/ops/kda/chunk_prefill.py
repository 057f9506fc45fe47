"""KDA's chunked delta rule (the prefill form) on tensor cores: the maths of
``srt/layers/attention/kda_chunk.py`` in four launches for one sequence.

Per chunk of ``CHUNK`` tokens (G = the in-chunk cumulative log decay, per key channel):
  1. ``G``: the cumulative sums, one program per (chunk, head).
  2. ``Aqk[i, j] = sum_c q_i k_j exp(G_i - G_j)`` (j <= i) and
     ``Akk[i, j] = beta_i sum_c k_i k_j exp(G_i - G_j)`` (j < i), one program per (``SUB``-row
     block, head) against its chunk's columns. The pairwise decay is factored through a
     reference row, ``exp(G_i - G_r) * exp(G_r - G_j)``, so each block is one ``tl.dot``; ``r``
     is the block's first row. Both factors stay finite in fp32 only while a block decays by
     less than ``MAX_FACTOR_EXP`` nats: ``(SUB - 1) * |lower bound| <= 80``, which the safe gate
     (bound -5, 75 nats) meets and the unbounded gate does not (``chunk_prefill_reason``). The
     same program inverts its diagonal ``(I + Akk)`` block row by row and stores
     ``Q * exp(G)`` and ``K * exp(G_last - G)`` for step 4.
  3. ``(I + Akk) W = diag(beta) (K * exp(G))`` and ``(I + Akk) U = diag(beta) V`` by block
     forward substitution, one program per (chunk, head): ``tl.dot`` with the blocks above and
     the diagonal block's inverse.
  4. The sequential part, one program per (head, block of V columns), the state ``S [K, BV]`` in
     registers across the chunks:
     ``V' = U - W S``, ``O = (Q * exp(G)) S + Aqk V'``,
     ``S <- exp(G_last) * S + (K * exp(G_last - G))^T V'``.
Every exponent in 3 and 4 is <= 0. The dots run in ``precision``: "ieee" (fp32 FMA), "tf32x3"
(three tf32 products, close to fp32) or "tf32".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.fit.decide import unfit_reason
from sglang.kernels.fit.footprint import Footprint
from sglang.kernels.fit.limits import H200, DeviceLimits, device_limits

CHUNK = 64
SUB = 16
# Largest exponent a factored decay may reach: exp(80) ~ 5.5e34 < fp32 max 3.4e38, and
# exp(-80) ~ 1.8e-35 is still a normal number.
MAX_FACTOR_EXP = 80.0
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
PRECISIONS = ("ieee", "tf32x3", "tf32")
DEFAULT_PRECISION = "tf32x3"


@triton.jit
def _chunk_cumsum_kernel(
    g_ptr,
    out_ptr,
    T,
    g_st,
    g_sh,
    o_st,
    o_sh,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    rows = c * CHUNK + tl.arange(0, CHUNK)
    ks = tl.arange(0, K)
    mask = (rows < T)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(g_ptr + r64 * g_st + h * g_sh + ks[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + r64 * o_st + h * o_sh + ks[None, :], tl.cumsum(g.to(tl.float32), 0), mask)


@triton.jit
def _chunk_intra_kernel(
    q_ptr,
    k_ptr,
    G_ptr,
    beta_ptr,
    aqk_ptr,
    akk_ptr,
    inv_ptr,
    qg_ptr,
    kd_ptr,
    T,
    q_st,
    q_sh,
    k_st,
    k_sh,
    b_st,
    b_sh,
    H: tl.constexpr,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    MAX_EXP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One ``SUB``-row block ``a`` of chunk ``c`` against the chunk's columns. The scratch
    buffers (G, aqk, akk, inv, qg, kd) are packed ``[T, H, *]``."""
    pid = tl.program_id(0)
    c = pid // (CHUNK // SUB)
    a = pid % (CHUNK // SUB)
    h = tl.program_id(1).to(tl.int64)
    start = c * CHUNK + a * SUB
    if start >= T:
        return
    ks = tl.arange(0, K)
    sub = tl.arange(0, SUB)
    rows = start + sub
    r64 = rows.to(tl.int64)[:, None]
    rmask = (rows < T)[:, None]
    q_a = tl.load(q_ptr + r64 * q_st + h * q_sh + ks[None, :], mask=rmask, other=0.0)
    k_a = tl.load(k_ptr + r64 * k_st + h * k_sh + ks[None, :], mask=rmask, other=0.0)
    G_a = tl.load(G_ptr + (r64 * H + h) * K + ks[None, :], mask=rmask, other=0.0)
    q_a = q_a.to(tl.float32)
    k_a = k_a.to(tl.float32)
    ref = tl.load(G_ptr + (start.to(tl.int64) * H + h) * K + ks)
    # rows at or after the reference: G_a - ref <= 0 (the min only guards masked rows)
    row_fac = tl.exp(tl.minimum(G_a - ref[None, :], 0.0))
    q_r = q_a * row_fac
    k_r = k_a * row_fac
    beta = tl.load(beta_ptr + rows.to(tl.int64) * b_st + h * b_sh, mask=rows < T, other=0.0)
    beta = beta.to(tl.float32)[:, None]
    # the chunk's columns: ref - G_j <= (SUB-1)|bound| up to this block; the clamp only bites on
    # columns after row i, which the causal mask drops
    cols = c * CHUNK + tl.arange(0, CHUNK)
    c64 = cols.to(tl.int64)[:, None]
    cmask = (cols < T)[:, None]
    k_all = tl.load(k_ptr + c64 * k_st + h * k_sh + ks[None, :], mask=cmask, other=0.0)
    G_all = tl.load(G_ptr + (c64 * H + h) * K + ks[None, :], mask=cmask, other=0.0)
    col_t = tl.trans(k_all.to(tl.float32) * tl.exp(tl.minimum(ref[None, :] - G_all, MAX_EXP)))
    i_loc = a * SUB + sub
    j_loc = tl.arange(0, CHUNK)
    s_qk = tl.dot(q_r, col_t, input_precision=PRECISION)
    s_kk = tl.dot(k_r, col_t, input_precision=PRECISION)
    offs = (r64 * H + h) * CHUNK + j_loc[None, :]
    akk = tl.where(j_loc[None, :] < i_loc[:, None], s_kk, 0.0) * beta
    tl.store(aqk_ptr + offs, tl.where(j_loc[None, :] <= i_loc[:, None], s_qk, 0.0), mask=rmask)
    tl.store(akk_ptr + offs, akk, mask=rmask)
    # this block's own columns, [SUB, SUB], picked out of the row block for their inverse
    blocks = tl.reshape(akk, [SUB, CHUNK // SUB, SUB])
    which = tl.arange(0, CHUNK // SUB)[None, :, None] == a
    inv = _unit_lower_inverse(tl.sum(tl.where(which, blocks, 0.0), axis=1), SUB)
    tl.store(inv_ptr + (r64 * H + h) * SUB + sub[None, :], inv, mask=rmask)
    # the sequential pass's operands: q * exp(G) and k * exp(G_last - G), both exponents <= 0
    last = (tl.minimum(c * CHUNK + CHUNK, T) - 1).to(tl.int64)
    G_last = tl.load(G_ptr + (last * H + h) * K + ks)
    rk = (r64 * H + h) * K + ks[None, :]
    tl.store(qg_ptr + rk, q_a * tl.exp(G_a), mask=rmask)
    tl.store(kd_ptr + rk, k_a * tl.exp(tl.minimum(G_last[None, :] - G_a, 0.0)), mask=rmask)


@triton.jit
def _unit_lower_inverse(a, N: tl.constexpr):
    """``(I + a)^-1`` for a strictly lower triangular ``[N, N]`` ``a``, row by row:
    ``inv[i] = e_i - sum_{j<i} a[i, j] inv[j]``."""
    r = tl.arange(0, N)
    inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, N):
        a_i = tl.sum(tl.where(r[:, None] == i, a, 0.0), axis=0)
        contrib = tl.sum(a_i[:, None] * inv, axis=0)
        inv = tl.where(r[:, None] == i, inv - contrib[None, :], inv)
    return inv


@triton.jit
def _chunk_solve_kernel(
    k_ptr,
    v_ptr,
    G_ptr,
    beta_ptr,
    akk_ptr,
    inv_ptr,
    w_ptr,
    u_ptr,
    T,
    k_st,
    k_sh,
    v_st,
    v_sh,
    b_st,
    b_sh,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``W`` and ``U`` of chunk ``c``, block row by block row (each needs the rows above it)."""
    c = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    ks = tl.arange(0, K)
    vs = tl.arange(0, V)
    sub = tl.arange(0, SUB)
    for a in range(CHUNK // SUB):
        start = c * CHUNK + a * SUB
        if start < T:
            rows = start + sub
            r64 = rows.to(tl.int64)[:, None]
            rmask = (rows < T)[:, None]
            beta = tl.load(beta_ptr + rows.to(tl.int64) * b_st + h * b_sh, mask=rows < T, other=0.0)
            beta = beta.to(tl.float32)[:, None]
            k_a = tl.load(k_ptr + r64 * k_st + h * k_sh + ks[None, :], mask=rmask, other=0.0)
            G_a = tl.load(G_ptr + (r64 * H + h) * K + ks[None, :], mask=rmask, other=0.0)
            v_a = tl.load(v_ptr + r64 * v_st + h * v_sh + vs[None, :], mask=rmask, other=0.0)
            rhs_w = k_a.to(tl.float32) * tl.exp(G_a) * beta
            rhs_u = v_a.to(tl.float32) * beta
            a_rows = akk_ptr + (r64 * H + h) * CHUNK
            for b in range(a):
                b64 = (c * CHUNK + b * SUB + sub).to(tl.int64)[:, None]
                a_ab = tl.load(a_rows + b * SUB + sub[None, :], mask=rmask, other=0.0)
                w_b = tl.load(w_ptr + (b64 * H + h) * K + ks[None, :])
                u_b = tl.load(u_ptr + (b64 * H + h) * V + vs[None, :])
                rhs_w -= tl.dot(a_ab, w_b, input_precision=PRECISION)
                rhs_u -= tl.dot(a_ab, u_b, input_precision=PRECISION)
            inv = tl.load(inv_ptr + (r64 * H + h) * SUB + sub[None, :], mask=rmask, other=0.0)
            w_a = tl.dot(inv, rhs_w, input_precision=PRECISION)
            u_a = tl.dot(inv, rhs_u, input_precision=PRECISION)
            tl.store(w_ptr + (r64 * H + h) * K + ks[None, :], w_a, mask=rmask)
            tl.store(u_ptr + (r64 * H + h) * V + vs[None, :], u_a, mask=rmask)
            # the next blocks read these rows back: make them visible to the whole program
            tl.debug_barrier()


@triton.jit
def _chunk_recurrence_kernel(
    qg_ptr,
    kd_ptr,
    G_ptr,
    aqk_ptr,
    w_ptr,
    u_ptr,
    s_in_ptr,
    s_out_ptr,
    o_ptr,
    T,
    o_st,
    o_sh,
    s_sh,
    s_sv,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    CHUNK: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    vs = tl.program_id(1) * BV + tl.arange(0, BV)
    ks = tl.arange(0, K)
    j_loc = tl.arange(0, CHUNK)
    # state rows are V, columns K as stored; held transposed as [K, BV]
    s_offs = h * s_sh + vs[None, :] * s_sv + ks[:, None]
    s = tl.load(s_in_ptr + s_offs).to(tl.float32)
    for c in range(tl.cdiv(T, CHUNK)):
        rows = c * CHUNK + j_loc
        r64 = rows.to(tl.int64)[:, None]
        rmask = (rows < T)[:, None]
        rk = (r64 * H + h) * K + ks[None, :]
        w = tl.load(w_ptr + rk, mask=rmask, other=0.0)
        u = tl.load(u_ptr + (r64 * H + h) * V + vs[None, :], mask=rmask, other=0.0)
        v_new = u - tl.dot(w, s, input_precision=PRECISION)
        qg = tl.load(qg_ptr + rk, mask=rmask, other=0.0)
        aqk = tl.load(aqk_ptr + (r64 * H + h) * CHUNK + j_loc[None, :], mask=rmask, other=0.0)
        o = tl.dot(qg, s, input_precision=PRECISION)
        o += tl.dot(aqk, v_new, input_precision=PRECISION)
        tl.store(o_ptr + r64 * o_st + h * o_sh + vs[None, :], o, mask=rmask)
        last = (tl.minimum(c * CHUNK + CHUNK, T) - 1).to(tl.int64)
        decay = tl.exp(tl.load(G_ptr + (last * H + h) * K + ks))
        kd = tl.load(kd_ptr + rk, mask=rmask, other=0.0)
        s = s * decay[:, None] + tl.dot(tl.trans(kd), v_new, input_precision=PRECISION)
    tl.store(s_out_ptr + s_offs, s)


def max_gate_bound_magnitude() -> float:
    """The largest per-token decay |lower bound| the factored pairwise decay allows."""
    return MAX_FACTOR_EXP / (SUB - 1)


def head_dims_reason(key_dim: int, value_dim: int) -> str | None:
    """Why the kernels cannot run heads of these widths; None when they can."""
    for name, n in (("key", key_dim), ("value", value_dim)):
        if n < MIN_HEAD_DIM or n > MAX_HEAD_DIM or n & (n - 1):
            return (
                f"KDA {name} head dim {n} is not a power of two in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
            )
    return None


def kda_footprint(head_dim: int) -> Footprint:
    """The largest program of the KDA kernels (prefill and decode) at heads of ``head_dim``: the
    sequential pass holds three fp32 ``[CHUNK, K]`` tiles (sm_90 compiler, Triton 3.6 and 3.9:
    at most 32 KiB below K = 64, 3 * 64 * K * 4 bytes from there; 96 KiB at K = 128)."""
    return Footprint(max(32768, 3 * CHUNK * head_dim * 4), 4)


def kda_unfit_reason(head_dim: int, limits: DeviceLimits | None) -> str | None:
    """None when the KDA kernels' programs at ``head_dim`` fit the device and the family is on,
    else why the torch KDA runs."""
    return unfit_reason("kda", kda_footprint(head_dim), limits, what=f"KDA heads of {head_dim}")


def chunk_prefill_reason(
    key_dim: int, value_dim: int, gate_lower_bound: float | None
) -> str | None:
    """Why the kernels cannot run heads of these widths under this gate; None when they can."""
    why = head_dims_reason(key_dim, value_dim)
    if why is not None:
        return why
    if gate_lower_bound is None:
        return "the unbounded KDA gate can decay a block past fp32's range (needs the safe gate)"
    if -gate_lower_bound > max_gate_bound_magnitude():
        return (
            f"KDA gate lower bound {gate_lower_bound} decays a {SUB}-row block by more than "
            f"{MAX_FACTOR_EXP:g} nats (the kernels take bounds >= "
            f"{-max_gate_bound_magnitude():.3f})"
        )
    return None


def default_block_v(value_dim: int, heads: int, sms: int = 132) -> int:
    """V columns a program of the sequential pass: 64, or fewer while the (head, V block)
    programs would not fill the ``sms`` SMs once. On the H200 (``bench_kda_prefill.py``, 8192
    tokens, heads of 128) the pass took, for 12 heads, 1.00 ms at 16 columns, 1.35 at 32 and
    2.42 at 64; for 96 heads 3.55 at 64, 3.89 at 32 and 4.66 at 16."""
    bv = min(64, value_dim)
    while bv > MIN_HEAD_DIM and heads * (value_dim // bv) < sms:
        bv //= 2
    return bv


def _sm_count(device: torch.device) -> int:
    # the interpreter (no limits): the H200's count keeps its choice
    return (device_limits(device) or H200).sm_count


def _check(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"KDA chunk prefill: {name} {tuple(t.shape)} does not match {shape}")
    if t.stride(-1) != 1:
        raise ValueError(f"KDA chunk prefill: {name} needs a contiguous last dim, got {t.stride()}")


def kda_chunk_prefill_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    out: torch.Tensor,
    state_out: torch.Tensor,
    *,
    precision: str = DEFAULT_PRECISION,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    intra_warps: int = 4,
) -> None:
    """One sequence: ``q, k, g [T, H, K]`` (q normalised and scaled, k normalised), ``v [T, H, V]``,
    ``beta [T, H]``, ``state [H, V, K]`` fp32. Writes ``out [T, H, V]`` (fp32) and the final state
    into ``state_out [H, V, K]`` (fp32; may be ``state`` itself). ``g`` must come from a gate
    ``chunk_prefill_reason`` accepts: the kernels do not read its values back to check."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    why = head_dims_reason(dk, dv)  # the gate is the caller's to check
    if why is not None:
        raise ValueError(why)
    if precision not in PRECISIONS:
        raise ValueError(f"KDA chunk prefill precision {precision!r} is not one of {PRECISIONS}")
    for name, x, shape in (
        ("q", q, (t, h, dk)),
        ("g", g, (t, h, dk)),
        ("v", v, (t, h, dv)),
        ("beta", beta, (t, h)),
        ("out", out, (t, h, dv)),
    ):
        _check(x, name, shape)
    for name, x in (("state", state), ("state_out", state_out)):
        _check(x, name, (h, dv, dk))
        if x.dtype != torch.float32:
            raise ValueError(f"KDA chunk prefill: {name} must be fp32, got {x.dtype}")
    if state.stride() != state_out.stride():
        raise ValueError("KDA chunk prefill: state and state_out need the same strides")
    if out.dtype != torch.float32 or g.dtype != torch.float32:
        raise ValueError("KDA chunk prefill: out and g must be fp32")
    bv = block_v or default_block_v(dv, h, _sm_count(k.device))
    if bv < MIN_HEAD_DIM or bv & (bv - 1) or dv % bv:
        raise ValueError(
            f"KDA chunk prefill: block_v {bv} must be a power of two >= 16 dividing {dv}"
        )
    if t == 0:
        state_out.copy_(state)
        return
    dev = k.device
    n_chunks = triton.cdiv(t, CHUNK)

    def scratch(width: int) -> torch.Tensor:
        return torch.empty(t, h, width, dtype=torch.float32, device=dev)

    cum, qg, kd, w = scratch(dk), scratch(dk), scratch(dk), scratch(dk)
    aqk, akk, inv, u = scratch(CHUNK), scratch(CHUNK), scratch(SUB), scratch(dv)
    _chunk_cumsum_kernel[(n_chunks, h)](
        g, cum, t, g.stride(0), g.stride(1), cum.stride(0), cum.stride(1), K=dk, CHUNK=CHUNK
    )
    _chunk_intra_kernel[(n_chunks * (CHUNK // SUB), h)](
        q, k, cum, beta, aqk, akk, inv, qg, kd, t,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), beta.stride(0), beta.stride(1),
        H=h, K=dk, CHUNK=CHUNK, SUB=SUB, MAX_EXP=MAX_FACTOR_EXP, PRECISION=precision,
        num_warps=intra_warps, num_stages=1,
    )  # fmt: skip
    _chunk_solve_kernel[(n_chunks, h)](
        k, v, cum, beta, akk, inv, w, u, t,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0), beta.stride(1),
        H=h, K=dk, V=dv, CHUNK=CHUNK, SUB=SUB, PRECISION=precision, num_warps=4, num_stages=1,
    )  # fmt: skip
    _chunk_recurrence_kernel[(h, dv // bv)](
        qg, kd, cum, aqk, w, u, state, state_out, out, t,
        out.stride(0), out.stride(1), state.stride(0), state.stride(1),
        H=h, K=dk, V=dv, CHUNK=CHUNK, BV=bv, PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
