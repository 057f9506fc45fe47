"""Fused MoE experts on MXFP4 weights (W4A16): the 4-bit bytes and UE8M0 scales are read as they
are resident and dequantised in registers; bf16 MMAs with fp32 accumulation.

Hopper has no FP4 MMA, so each GEMM loads a tile of packed weights (64 bytes, 128 E2M1 values a
row) and the row's four scale bytes, turns them into bf16 in the MMA's own operand layout
(``mxfp4_operand.py``: every E2M1 value times a power of two in bf16's range is a bf16 value, so
this is exact) and multiplies by the activations. At decode the MoE streams weights, and these are
a quarter of the bf16 bytes (plus one scale byte per 32 values).

The pipeline is ``fused_moe.py``'s two-launch one, with the weights on the MMA's left:

1. ``moe_align_any_order`` groups routed rows by expert in tiles of ``block_m`` rows (one token:
   each slot gets a tile of its own).
2. GEMM 1 (``_mxfp4_gemm1_kernel``): ``gate^T`` and ``up^T`` tiles ``[block_n, block_m]`` of one
   expert side by side, the gated activation (``gated_act``: clamped SwiGLU, SiTU) in the epilogue;
   writes ``inter`` [S, I] in GEMM 2's K order (``dot_order_position``).
3. GEMM 2 (``_mxfp4_gemm2_kernel``): ``(w2 @ inter^T)`` times each row's top-k weight -> [S, H].
4. The combine kernel of ``fused_moe.py`` sums each token's k rows; masked ids (-1, or any id
   outside [0, E)) contribute nothing.

The weights may be in the checkpoint layout, the prepared one or DeepGEMM's MegaMoE layout
(``mxfp4_weights.py``); the layout is a pair of constexpr flags (row interleave of gate/up, UTCCP
scale rows), so one kernel reads all of them. Everything is sized by the shapes alone: no host
reads, CUDA-graph safe. Tiles come from ``mxfp4_config.py`` (tables, default rule); a config with
``kernel="split"`` runs both GEMMs on the decode kernel of ``mxfp4_split_gemm.py`` instead (every
load pipelined, gate and up rows in one tile) and steps 1 and 4 as here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.activation import activation_code, gated_act
from sglang.kernels.ops.interp_dot import dot
from sglang.kernels.ops.moe.align import moe_align_any_order
from sglang.kernels.ops.moe.fused_moe import (
    CHUNK_TOKENS,
    MoEProblem,
    _launch_sum,
    _tile_coords,
    _tile_rows,
    check_routing_and_out,
    experts_reference,
    resolve_moe_output,
    routing_operands,
)
from sglang.kernels.ops.moe.mxfp4_config import (
    SPLIT,
    Mxfp4MoeConfig,
    mxfp4_config_fits,
    select_mxfp4_config,
)
from sglang.kernels.ops.moe.mxfp4_operand import (
    ASM_ACC_SCALE,
    MXFP4_BLOCK_K,
    dot_order_position,
    hidden_row_tile,
    reorder_hidden_columns,
    store_transposed,
    stored_gate_up_rows,
    stored_scale_rows,
    to_dot_order,
    weight_tile,
    weighted_by_topk,
)
from sglang.kernels.ops.moe.mxfp4_split_gemm import hidden_in_split_order, launch_split_gemm
from sglang.kernels.ops.moe.mxfp4_weights import (
    PLAIN_LAYOUT,
    Mxfp4Layout,
    Mxfp4MoeWeights,
)
from sglang.kernels.ops.triton_dispatch import interpreter_enabled, triton_can_run

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
_BK = tl.constexpr(MXFP4_BLOCK_K)
_BYTES = tl.constexpr(MXFP4_BLOCK_K // 2)  # packed weight bytes of a tile row
_ACC_SCALE = tl.constexpr(ASM_ACC_SCALE)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _act_operand(a_ptrs, row_ok, IN_DOT_ORDER: tl.constexpr, BLOCK_M: tl.constexpr):
    # The activation tile as the MMA's right operand [128, BLOCK_M], in the tiles' K order.
    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
    if not IN_DOT_ORDER:
        a = to_dot_order(a, BLOCK_M, _BK)
    return tl.trans(a)


@triton.jit
def _next_scales(s_ptrs, kb, k_dim, BLOCK_N: tl.constexpr):
    # The scale bytes [BLOCK_N, 4] of the K tile after kb (0 past K): scale bytes are too small
    # for the asynchronous copies, so each tile's are loaded one tile ahead by hand.
    more = (kb + _BK + tl.zeros((BLOCK_N, 4), dtype=tl.int32)) < k_dim
    return tl.load(s_ptrs, mask=more, other=0)


@triton.jit
def _mxfp4_gemm1_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    num_slots,
    num_m_blocks,
    n_cols,  # I
    k_dim,  # H
    top_k,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_om,
    limit,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    X_IN_DOT_ORDER: tl.constexpr,
    GATE_UP_GRANULE: tl.constexpr,
    SCALE_UTCCP: tl.constexpr,
    ASM: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(num_m_blocks, n_cols, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    slot, row_ok = _tile_rows(pid_m, sorted_ids_ptr, num_slots, BLOCK_M)
    x_row = (slot // top_k).to(tl.int64)  # every slot of a token reads the token's row
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % n_cols
    gate = stored_gate_up_rows(cols, 0, n_cols, GATE_UP_GRANULE)
    up = stored_gate_up_rows(cols, 1, n_cols, GATE_UP_GRANULE)
    w_base = w_ptr + expert * stride_we
    offs_b = tl.arange(0, _BYTES)
    g_ptrs = w_base + gate.to(tl.int64)[:, None] * stride_wn + offs_b[None, :]
    u_ptrs = w_base + up.to(tl.int64)[:, None] * stride_wn + offs_b[None, :]
    s_base = ws_ptr + expert * stride_wse
    offs_s = tl.arange(0, 4)[None, :]  # the four scale bytes of a row's 128 values of K
    gs_ptrs = (
        s_base + stored_scale_rows(gate, SCALE_UTCCP).to(tl.int64)[:, None] * stride_wsn + offs_s
    )
    us_ptrs = (
        s_base + stored_scale_rows(up, SCALE_UTCCP).to(tl.int64)[:, None] * stride_wsn + offs_s
    )
    x_ptrs = x_ptr + x_row[:, None] * stride_xm + tl.arange(0, _BK)[None, :]

    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # scale bytes one tile ahead (_next_scales)
    gs = tl.load(gs_ptrs)
    us = tl.load(us_ptrs)
    for kb in range(0, k_dim, _BK):
        gs_ptrs += stride_wsk
        us_ptrs += stride_wsk
        gs_next = _next_scales(gs_ptrs, kb, k_dim, BLOCK_N)
        us_next = _next_scales(us_ptrs, kb, k_dim, BLOCK_N)
        xt = _act_operand(x_ptrs, row_ok, X_IN_DOT_ORDER, BLOCK_M)
        wg = weight_tile(tl.load(g_ptrs), gs, BLOCK_N, x_ptr.dtype.element_ty, ASM)
        acc_g = dot(wg, xt, acc_g, DOT_F32)
        wu = weight_tile(tl.load(u_ptrs), us, BLOCK_N, x_ptr.dtype.element_ty, ASM)
        acc_u = dot(wu, xt, acc_u, DOT_F32)
        x_ptrs += _BK
        g_ptrs += _BYTES
        u_ptrs += _BYTES
        gs = gs_next
        us = us_next

    if ASM:  # the fast path's weights entered the MMA scaled by 2**-62
        acc_g = acc_g * _ACC_SCALE
        acc_u = acc_u * _ACC_SCALE
    act = gated_act(acc_g, acc_u, limit, ACTIVATION, HAS_LIMIT)  # [BLOCK_N, BLOCK_M]
    # GEMM 2 reads this row in its tiles' K order
    store_transposed(
        out_ptr, slot.to(tl.int64), dot_order_position(cols, _BK), row_ok, stride_om, act
    )


@triton.jit
def _mxfp4_gemm2_kernel(
    a_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    num_slots,
    num_m_blocks,
    n_cols,  # H
    k_dim,  # I
    stride_am,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_om,
    SCALE_UTCCP: tl.constexpr,
    ASM: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(num_m_blocks, n_cols, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    slot, row_ok = _tile_rows(pid_m, sorted_ids_ptr, num_slots, BLOCK_M)
    a_row = slot.to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % n_cols
    w_ptrs = (
        w_ptr
        + expert * stride_we
        + cols.to(tl.int64)[:, None] * stride_wn
        + tl.arange(0, _BYTES)[None, :]
    )
    s_rows = stored_scale_rows(cols, SCALE_UTCCP).to(tl.int64)
    s_ptrs = ws_ptr + expert * stride_wse + s_rows[:, None] * stride_wsn + tl.arange(0, 4)[None, :]
    a_ptrs = a_ptr + a_row[:, None] * stride_am + tl.arange(0, _BK)[None, :]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    ws = tl.load(s_ptrs)  # scale bytes one tile ahead, as in GEMM 1
    for kb in range(0, k_dim, _BK):
        s_ptrs += stride_wsk
        ws_next = _next_scales(s_ptrs, kb, k_dim, BLOCK_N)
        at = _act_operand(a_ptrs, row_ok, True, BLOCK_M)  # GEMM 1 wrote it in dot order
        w = weight_tile(tl.load(w_ptrs), ws, BLOCK_N, a_ptr.dtype.element_ty, ASM)
        acc = dot(w, at, acc, DOT_F32)
        a_ptrs += _BK
        w_ptrs += _BYTES
        ws = ws_next

    acc = weighted_by_topk(acc, topk_weights_ptr, a_row, row_ok, ASM)
    store_transposed(out_ptr, a_row, cols, row_ok, stride_om, acc)


@triton.jit
def _dot_order_rows_kernel(x_ptr, out_ptr, rows, stride_xm, stride_om, BLOCK_M: tl.constexpr):
    # The hidden states with every 128 columns in the tiles' K order (GEMM 1 at prefill sizes).
    x, m, offs_k, ok = hidden_row_tile(x_ptr, rows, stride_xm, BLOCK_M)
    tl.store(out_ptr + m * stride_om + offs_k[None, :], to_dot_order(x, BLOCK_M, _BK), mask=ok)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def check_mxfp4_moe_inputs(
    hidden: torch.Tensor,
    weights: Mxfp4MoeWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor | None,
) -> MoEProblem:
    """The problem's sizes; a ``ValueError`` naming what does not fit."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got {tuple(hidden.shape)}")
    if hidden.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"MXFP4 experts take bf16 or fp16 activations, got {hidden.dtype}")
    tokens, h = hidden.shape
    if h != weights.hidden:
        raise ValueError(f"hidden has {h} columns, the experts take H={weights.hidden}")
    check_routing_and_out(hidden, topk_weights, topk_ids, out)
    if hidden.device != weights.w13.device:
        raise ValueError(f"hidden is on {hidden.device}, the experts on {weights.w13.device}")
    return MoEProblem(
        tokens, h, weights.inter, weights.num_experts, topk_ids.shape[1], False, (0, 0)
    )


def asm_dequant(dtype: torch.dtype) -> bool:
    """Whether the weight tiles take the fast dequantisation (the inline PTX of
    ``mxfp4_operand.weight_tile``, weights scaled by 2**-62): bf16 activations on the GPU; fp16
    ones and the interpreter take the portable one."""
    return dtype == torch.bfloat16 and not interpreter_enabled()


def _launch_gemm1(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    inter: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    p: MoEProblem,
    num_slots: int,
    cfg: Mxfp4MoeConfig,
    layout: Mxfp4Layout,
    act: int,
    limit: float | None,
) -> None:
    sorted_ids, expert_ids, ntpp = align
    tile = cfg.gemm1
    num_m_blocks = expert_ids.shape[0]
    asm = asm_dequant(x.dtype)
    _mxfp4_gemm1_kernel[(num_m_blocks * triton.cdiv(p.inter, tile.block_n),)](
        x, w13, s13, inter, sorted_ids, expert_ids, ntpp,
        num_slots, num_m_blocks, p.inter, p.hidden, p.top_k,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), s13.stride(2),
        inter.stride(0), float(limit or 0.0),
        ACTIVATION=act, HAS_LIMIT=limit is not None, X_IN_DOT_ORDER=cfg.x_in_dot_order,
        GATE_UP_GRANULE=layout.gate_up_granule, SCALE_UTCCP=layout.scale_utccp, ASM=asm,
        DOT_F32=interpreter_enabled(), BLOCK_M=cfg.block_m, BLOCK_N=tile.block_n,
        GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip


def _launch_gemm2(
    inter: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    p: MoEProblem,
    num_slots: int,
    cfg: Mxfp4MoeConfig,
    layout: Mxfp4Layout,
) -> None:
    sorted_ids, expert_ids, ntpp = align
    tile = cfg.gemm2
    num_m_blocks = expert_ids.shape[0]
    asm = asm_dequant(inter.dtype)
    _mxfp4_gemm2_kernel[(num_m_blocks * triton.cdiv(p.hidden, tile.block_n),)](
        inter, w2, s2, down, topk_weights, sorted_ids, expert_ids, ntpp,
        num_slots, num_m_blocks, p.hidden, p.inter,
        inter.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), s2.stride(2),
        down.stride(0),
        SCALE_UTCCP=layout.scale_utccp, ASM=asm, DOT_F32=interpreter_enabled(),
        BLOCK_M=cfg.block_m, BLOCK_N=tile.block_n, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip


def _launch_split(
    x: torch.Tensor,
    weights: Mxfp4MoeWeights,
    inter: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    p: MoEProblem,
    num_slots: int,
    cfg: Mxfp4MoeConfig,
    act: int,
    limit: float | None,
) -> None:
    """Both GEMMs on the split kernel (``mxfp4_split_gemm.py``)."""
    w13, w2, _, _ = weights.kernel_operands
    s13, s2 = weights.scale_word_operands
    asm = asm_dequant(x.dtype)
    common = {
        "num_slots": num_slots, "top_k": p.top_k, "block_m": cfg.block_m,
        "scale_utccp": weights.layout.scale_utccp, "asm": asm, "dot_f32": interpreter_enabled(),
    }  # fmt: skip
    for gate_up, a, w, words, out, n_cols, k_dim, tile in (
        (True, x, w13, s13, inter, p.inter, p.hidden, cfg.gemm1),
        (False, inter, w2, s2, down, p.hidden, p.inter, cfg.gemm2),
    ):
        launch_split_gemm(
            a, w, words, out, None if gate_up else topk_weights, align, gate_up=gate_up,
            n_cols=n_cols, k_dim=k_dim, block_n=tile.block_n, group_m=tile.group_m,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
            a_in_order=cfg.x_in_dot_order, granule=weights.layout.gate_up_granule,
            activation=act if gate_up else 0, limit=limit if gate_up else None, **common,
        )  # fmt: skip


def hidden_in_dot_order(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [T, H] with every 128 columns in the GEMM tiles' K order (one small kernel)."""
    return reorder_hidden_columns(_dot_order_rows_kernel, x, out)


def fused_experts_mxfp4_weights(
    hidden: torch.Tensor,
    weights: Mxfp4MoeWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "swiglu",
    swiglu_limit: float | None = None,
    inplace: bool = False,
    out: torch.Tensor | None = None,
    config: Mxfp4MoeConfig | None = None,
) -> torch.Tensor:
    """:func:`fused_experts_mxfp4` on a resident bundle (:class:`Mxfp4MoeWeights`, any layout)."""
    if not triton_can_run(hidden):
        return fused_experts_mxfp4_weights_torch(
            hidden, weights, topk_weights, topk_ids, activation=activation,
            swiglu_limit=swiglu_limit, inplace=inplace, out=out,
        )  # fmt: skip
    act = activation_code(activation, swiglu_limit)
    p = check_mxfp4_moe_inputs(hidden, weights, topk_weights, topk_ids, out)
    if config is not None:
        why = mxfp4_config_fits(config, p.hidden, p.inter)
        if why:
            raise ValueError(f"MXFP4 MoE config {config} cannot run: {why}")
    result = resolve_moe_output(hidden, inplace, out)
    if p.tokens == 0:
        return result
    w13, w2, s13, s2 = weights.kernel_operands
    ids, tw = routing_operands(topk_ids, topk_weights)

    chunk = min(p.tokens, CHUNK_TOKENS)
    max_slots = chunk * p.top_k
    dev, dt = hidden.device, hidden.dtype
    inter_cache = torch.empty((max_slots, p.inter), dtype=dt, device=dev)
    down_cache = torch.empty((max_slots, p.hidden), dtype=dt, device=dev)
    x_cache: torch.Tensor | None = None
    for start in range(0, p.tokens, chunk):
        end = min(start + chunk, p.tokens)
        n_tok = end - start
        num_slots = n_tok * p.top_k
        cfg = config or select_mxfp4_config(
            n_tok, p.num_experts, p.hidden, p.inter, top_k=p.top_k, device=dev
        )
        chunk_ids = ids[start:end]
        align = moe_align_any_order(chunk_ids, cfg.block_m, p.num_experts)
        x = hidden[start:end]
        if cfg.x_in_dot_order:
            if x_cache is None:
                x_cache = torch.empty((chunk, p.hidden), dtype=dt, device=dev)
            reorder = hidden_in_split_order if cfg.kernel == SPLIT else hidden_in_dot_order
            x = reorder(x, x_cache[:n_tok])
        inter = inter_cache[:num_slots]
        down = down_cache[:num_slots]
        if cfg.kernel == SPLIT:
            _launch_split(
                x, weights, inter, down, tw[start:end], align, p, num_slots, cfg, act,
                swiglu_limit,
            )  # fmt: skip
        else:
            _launch_gemm1(
                x, w13, s13, inter, align, p, num_slots, cfg, weights.layout, act, swiglu_limit
            )
            _launch_gemm2(
                inter, w2, s2, down, tw[start:end], align, p, num_slots, cfg, weights.layout
            )
        _launch_sum(down, chunk_ids, result[start:end], p)
    return result


def fused_experts_mxfp4(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "swiglu",
    swiglu_limit: float | None = None,
    inplace: bool = False,
    out: torch.Tensor | None = None,
    config: Mxfp4MoeConfig | None = None,
    layout: Mxfp4Layout = PLAIN_LAYOUT,
) -> torch.Tensor:
    """Routed experts on MXFP4 weights: ``out[t] = sum_s topk_weights[t, s] * E_{ids[t, s]}(x[t])``
    with ``E_e(x) = w2[e] @ act(w13[e, :I] @ x, w13[e, I:] @ x)``, the weights dequantised exactly.

    Shapes (checkpoint layout): ``hidden`` [T, H] bf16/fp16; ``w13`` uint8/int8 [E, 2I, H/2] (gate
    rows, then up), ``w2`` [E, H, I/2]; ``w13_scale`` [E, 2I, H/32], ``w2_scale`` [E, H, I/32] UE8M0
    bytes (uint8 / float8_e8m0fnu) or int32 words of four ``[E, N, K/128]`` (any strides, e.g.
    :func:`prepare_mxfp4_moe_weights`'s); ``layout`` says how rows and scales are laid out (e.g.
    ``MEGA_MOE_LAYOUT`` for DeepGEMM's SM100 MegaMoE bytes). H and I must be multiples of 128.
    ``topk_weights`` fp32 [T, k], ``topk_ids`` int32 [T, k]; ids outside [0, E) (e.g. -1) are
    skipped. ``activation``: "swiglu" (``swiglu_limit`` clamps it) or "situ".

    Output allocation contract, as :func:`~sglang.kernels.ops.moe.fused_moe.fused_experts`:
    ``inplace=True`` writes into ``hidden`` and returns it; else ``out`` if given; else a new
    ``torch.empty_like(hidden)``. Only intermediate caches are allocated here. ``config`` forces
    the tiles (tuning, tests); by default they come from the tuned table or the default rule.
    Off CUDA (and without ``TRITON_INTERPRET=1``) this runs :func:`fused_experts_mxfp4_torch`.

    bf16 activations take the fast dequantisation (exact for scales 2**-63 .. 2**63); fp16 ones
    take the portable one (dequantised to fp16: exact while the values are in fp16's range)."""
    weights = Mxfp4MoeWeights(w13, w2, w13_scale, w2_scale, layout)
    return fused_experts_mxfp4_weights(
        hidden, weights, topk_weights, topk_ids, activation=activation,
        swiglu_limit=swiglu_limit, inplace=inplace, out=out, config=config,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Torch reference (the oracle; the path off CUDA)
# --------------------------------------------------------------------------------------------


def fused_experts_mxfp4_weights_torch(
    hidden: torch.Tensor,
    weights: Mxfp4MoeWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "swiglu",
    swiglu_limit: float | None = None,
    inplace: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fused_experts_mxfp4_torch` on a resident bundle."""
    activation_code(activation, swiglu_limit)
    p = check_mxfp4_moe_inputs(hidden, weights, topk_weights, topk_ids, out)
    result = resolve_moe_output(hidden, inplace, out)
    if p.tokens == 0:
        return result

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        w13_e, w2_e = weights.dequantized(torch.float32, torch.tensor([e], device=hidden.device))
        return w13_e[0], w2_e[0]

    return experts_reference(
        hidden, topk_weights, topk_ids, p, result, expert, torch.Tensor.float, activation,
        swiglu_limit,
    )  # fmt: skip


def fused_experts_mxfp4_torch(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "swiglu",
    swiglu_limit: float | None = None,
    inplace: bool = False,
    out: torch.Tensor | None = None,
    layout: Mxfp4Layout = PLAIN_LAYOUT,
) -> torch.Tensor:
    """The oracle of :func:`fused_experts_mxfp4` (same signature and output contract): each used
    expert dequantised (exactly), then ``fused_experts_torch``'s maths: fp32 GEMMs, the activation
    on fp32 gate/up, the intermediate and each weighted expert output rounded to ``hidden``'s
    dtype, the k rows summed in fp32."""
    weights = Mxfp4MoeWeights(w13, w2, w13_scale, w2_scale, layout)
    return fused_experts_mxfp4_weights_torch(
        hidden, weights, topk_weights, topk_ids, activation=activation,
        swiglu_limit=swiglu_limit, inplace=inplace, out=out,
    )  # fmt: skip
