"""Compile Triton kernels for sm_90 on this machine (no GPU) as their launchers would launch them,
and print a digest of each kernel's PTX with the debug information left out: a refactor of a
launcher or of a ``@triton.jit`` helper that must not change the code the GPU runs shows the same
digests before and after.

The launchers run on CPU tensors with ``JITFunction.run`` replaced by a recorder, so every
argument (pointers with their element type, integers, floats, constexprs, ``num_warps``,
``num_stages``) is what the real launch passes. Pointers, and integers that are multiples of 16,
get the divisibility a real launch of 16-byte-aligned tensors gives them.

    python scripts/kernel_ptx_digest.py                 # name, digest, registers per kernel
    python scripts/kernel_ptx_digest.py --dump DIR      # also each stripped PTX as DIR/NAME.ptx
    python scripts/kernel_ptx_digest.py --compare DIR   # exit 1 when a PTX differs from DIR's
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from sglang.test.sm90_compile import compile_sm90

_TRITON_DTYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
}


@dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel and its arguments by name (``fp_fusion``: the launch's
    ``enable_fp_fusion``, None when it passes none)."""

    fn: JITFunction
    args: dict[str, Any]
    num_warps: int
    num_stages: int
    fp_fusion: bool | None = None


@contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Every ``kernel[grid](...)`` inside the block is recorded instead of launched."""
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self: JITFunction, *args: Any, grid: Any = None, warmup: bool = False, **kw: Any):  # type: ignore[no-untyped-def]
        warps = int(kw.pop("num_warps", 4))
        stages = int(kw.pop("num_stages", 3))
        fp_fusion = kw.pop("enable_fp_fusion", None)
        named = dict(zip(self.arg_names, args, strict=False))
        named.update({k: v for k, v in kw.items() if k in self.arg_names})
        launches.append(Launch(self, named, warps, stages, fp_fusion))

    JITFunction.run = record  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        JITFunction.run = original  # type: ignore[method-assign]


def compile_launch(launch: Launch) -> Any:
    """The sm_90 compile of a recorded launch."""
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    aligned: list[str] = []
    for index, name in enumerate(launch.fn.arg_names):
        value = launch.args[name]
        if launch.fn.params[index].is_constexpr:
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_DTYPES[value.dtype]
            aligned.append(name)
        elif isinstance(value, TensorDescriptor):  # a TMA operand: element type and block
            block = ", ".join(str(b) for b in value.block_shape)
            signature[name] = f"tensordesc<{_TRITON_DTYPES[value.base.dtype]}[{block}]>"
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                aligned.append(name)
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value is None:
            constexprs[name] = None
        else:
            raise TypeError(f"{launch.fn.__name__}: argument {name} of type {type(value)}")
    with triton.knobs.language.scope():
        if launch.fp_fusion is False:  # e.g. the compressors: every product rounded
            triton.knobs.language.force_disable_fp_fusion = True
        return compile_sm90(
            launch.fn, signature, constexprs, launch.num_warps, launch.num_stages, tuple(aligned)
        )


def stripped_ptx(ptx: str) -> str:
    """The PTX without its debug information: ``.loc`` / ``.file`` lines, debug sections and the
    ``$L__tmpN`` labels that only mark source ranges (an inlined helper adds some)."""
    out, skipping = [], False
    for line in ptx.splitlines():
        text = line.strip()
        if text.startswith(".section") and ".debug" in text:
            skipping = True
            continue
        if skipping:
            if text == "}":
                skipping = False
            continue
        if text.startswith((".loc", ".file", "//")) or not text:
            continue
        if re.fullmatch(r"\$L__tmp\d+:", text):
            continue
        out.append(re.sub(r"\s+//.*$", "", line.rstrip()))
    return "\n".join(out) + "\n"


# --- the launchers, on small CPU inputs ---------------------------------------------------------


def _sparse_decode() -> None:
    from sglang.kernels.ops.attention.sparse_decode_attention import sparse_decode_attention

    bs, heads, d, slots, window, entries = 2, 16, 64, 3, 8, 16
    q = torch.randn(bs, heads, d, dtype=torch.bfloat16)
    ring = torch.randn(slots, window, d, dtype=torch.bfloat16)
    ent = torch.randn(slots, entries, d, dtype=torch.bfloat16)
    idx = torch.tensor([0, 2])
    pos = torch.tensor([5, 30])
    sink = torch.randn(heads)
    picks = torch.zeros(bs, 4, dtype=torch.int32)
    sparse_decode_attention(q, ring, idx, pos, sink, 0.1, entries=ent, ratio=4, picks=picks)
    # paged FP8 entries (--kv-cache-dtype fp8_e4m3), read through a block table
    from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat

    fmt = Fp8RowFormat(d, 16)
    blocks = fmt.quantize(torch.randn(5, 4, d))
    table = torch.arange(slots * 2, dtype=torch.int64).view(slots, 2) % 5
    sparse_decode_attention(
        q, ring, idx, pos, sink, 0.1, entries=blocks, ratio=4, table=table, entry_fp8=fmt
    )


def _absorbed_decode() -> None:
    from sglang.kernels.ops.attention.absorbed_mla_decode import absorbed_mla_decode

    bs, heads, latent, rope, blocks, rows = 2, 16, 512, 64, 4, 16
    q_lat = torch.randn(bs, heads, latent)
    q_pe = torch.randn(bs, heads, rope)
    store = torch.randn(blocks, rows, latent + rope, dtype=torch.bfloat16)
    table = torch.arange(4, dtype=torch.int32).view(bs, 2)
    absorbed_mla_decode(q_lat, q_pe, store, table, torch.tensor([20, 9]), 0.05)
    from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat

    fmt = Fp8RowFormat(latent + rope, rope)  # FP8 latents, the rope part kept bf16
    rows = fmt.quantize(torch.randn(blocks, 16, latent + rope))
    absorbed_mla_decode(q_lat, q_pe, rows, table, torch.tensor([20, 9]), 0.05, fp8=fmt)


def _sparse_prefill() -> None:
    from sglang.kernels.ops.attention.sparse_prefill_attention import sparse_prefill_attention

    n, heads, d = 8, 16, 64
    q = torch.randn(n, heads, d, dtype=torch.bfloat16)
    win = torch.randn(n, d, dtype=torch.bfloat16)
    ent = torch.randn(4, d, dtype=torch.bfloat16)
    sparse_prefill_attention(
        q, 0, win, 0, torch.randn(heads), scale=0.1, window=4, entries=ent, ratio=2
    )


def _norm_rope() -> None:
    from sglang.kernels.ops.attention import norm_rope as k

    x = torch.randn(4, 8, 128, dtype=torch.bfloat16)
    cos, sin = torch.randn(4, 32), torch.randn(4, 32)
    w = torch.randn(128, dtype=torch.bfloat16)
    if hasattr(k, "RowNorm"):  # the norm as one bundle
        weighted = {"norm": k.RowNorm.weighted(w, 1e-6)}
        unweighted = {"norm": k.RowNorm.unweighted(1e-6)}
    else:
        weighted = {"norm": "weighted", "weight": w, "eps": 1e-6}
        unweighted = {"norm": "unweighted", "eps": 1e-6}
    k.norm_rope(x, cos, sin, out=torch.empty_like(x), **weighted)
    k.norm_rope(x, cos, sin, out=torch.empty_like(x), **unweighted)
    k.norm_rope(x.float(), cos, sin, out=torch.empty_like(x), inverse=True)


def _mhc() -> None:
    from sglang.kernels.ops.layernorm import mhc_triton

    t, hc, h = 4, 4, 256
    n_mix = (2 + hc) * hc
    res = torch.randn(t, hc, h, dtype=torch.bfloat16)
    fn = torch.randn(n_mix, hc * h)
    scale, base = torch.randn(3), torch.randn(n_mix)
    norm_w = torch.randn(h, dtype=torch.bfloat16)
    out = torch.empty(t, h, dtype=torch.bfloat16)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    post, comb = torch.rand(t, hc), torch.rand(t, hc, hc)
    mhc_triton.mhc_pre_triton(res, fn, scale, base, out, **_mhc_scalars(norm_w))
    mhc_triton.mhc_post_triton(x, res, post, comb)
    mhc_triton.mhc_fused_post_pre_triton(
        res, x, post, comb, torch.empty_like(res), fn, scale, base, out, **_mhc_scalars(norm_w)
    )


def _mhc_scalars(norm_w: torch.Tensor) -> dict[str, Any]:
    """The mHC constants, as the launcher in this tree takes them."""
    import inspect

    from sglang.kernels.ops.layernorm import mhc_triton

    values = {"rms_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 20}
    names = inspect.signature(mhc_triton.mhc_pre_triton).parameters
    if "params" in names:
        from sglang.kernels.ops.layernorm.mhc_params import MhcParams

        return {"params": MhcParams(**values, norm_weight=norm_w, norm_eps=1e-6)}
    return {**values, "norm_weight": norm_w, "norm_eps": 1e-6}


@contextmanager
def _triton_path(*modules: Any) -> Iterator[None]:
    """The launchers' Triton path on CPU tensors: the ``triton_can_run`` gate of ``modules`` says
    yes (other modules keep their torch paths: the MoE's expert alignment and FP8 quantiser
    compute the same sizes)."""
    saved = [m.triton_can_run for m in modules]
    for m in modules:
        m.triton_can_run = lambda t: True
    try:
        yield
    finally:
        for m, fn in zip(modules, saved, strict=True):
            m.triton_can_run = fn


def _fp8_gemm() -> None:
    from sglang.kernels.ops.gemm import fp8_block_gemm as g
    from sglang.kernels.ops.gemm.fp8_gemm_config import Fp8GemmConfig
    from sglang.kernels.ops.quant.fp8 import FP8_DTYPE

    m, n, k, groups = 16, 256, 512, 2
    a_q = torch.randn(m, k).to(FP8_DTYPE)
    a_s = torch.rand(m, k // 128)
    w_q = torch.randn(n, k).to(FP8_DTYPE)
    w_s = torch.rand(n // 128, k // 128)
    g.fp8_block_gemm(a_q, a_s, w_q, w_s)  # the table's tile for M
    g.fp8_block_gemm(a_q, a_s, w_q, w_s, out_dtype=torch.float16)
    split = Fp8GemmConfig(64, 128, split_k=2, num_stages=3)  # + the split-K reduce
    g.fp8_block_gemm(a_q, a_s, w_q, w_s, config=split)
    g.fp8_gemm_partials(a_q, a_s, w_q, w_s, config=split)
    g.fp8_gemm_quant_out(a_q, a_s, w_q, w_s)
    g.fp8_gemm_quant_out(a_q, a_s, w_q, w_s, config=split)
    for whole_k in (Fp8GemmConfig(64, 128), Fp8GemmConfig(16, 128, swap_ab=True)):  # no split
        g.fp8_block_gemm(a_q, a_s, w_q, w_s, config=whole_k)
        g.fp8_gemm_quant_out(a_q, a_s, w_q, w_s, config=whole_k)
    ga_q = torch.randn(m, groups, k).to(FP8_DTYPE)
    ga_s = torch.rand(m, groups, k // 128)
    gw_q = torch.randn(groups * n, k).to(FP8_DTYPE)
    gw_s = torch.rand(groups * n // 128, k // 128)
    g.fp8_grouped_gemm(ga_q, ga_s, gw_q, gw_s)
    g.fp8_gemm_quant_out(ga_q, ga_s, gw_q, gw_s)


def _fused_quant() -> None:
    from sglang.kernels.ops.quant import fused_quant as fq

    m, n = 4, 1536
    x = torch.randn(m, n, dtype=torch.bfloat16)
    w = torch.randn(n)
    with _triton_path(fq):
        fq.rms_norm_quant_fp8(x, w, 1e-6)
        fq.rms_norm_quant_fp8(x, w, 1e-6, normed_out=torch.empty_like(x))
        fq.rms_norm_quant_fp8(torch.randn(2, m, n), w, 1e-6)  # split-K partials summed first
        gate, up = torch.randn(m, 1024, dtype=torch.bfloat16), torch.randn(m, 1024).bfloat16()
        fq.gated_act_quant_fp8(gate, up, "swiglu", 7.0)
        fq.gated_act_quant_fp8(gate, up, "swiglu")
        fq.gated_act_quant_fp8(gate.half(), up.half(), "situ")


def _mhc_sinkhorn_scalar() -> None:
    from sglang.kernels.ops.layernorm import mhc_sinkhorn_scalar as sk

    c = torch.randn(8, 4, 4)
    sk.sinkhorn_scalar(c, 1e-6, 20)
    sk.sinkhorn_tile(c, 1e-6, 20)


def _compressor_maths(ratio: int, width: int, d: int) -> Any:
    from sglang.kernels.ops.attention.compressor_entry import EntryMaths

    return EntryMaths(torch.randn(ratio, width), torch.rand(d) + 0.5, 1e-6, torch.rand(32), 1.0)


def _compressor_decode() -> None:
    from sglang.kernels.ops.attention.compressor_decode import compress_decode
    from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat

    bs, slots, blocks, rows = 3, 4, 6, 8
    fp8 = Fp8RowFormat(512, 64)
    # DeepSeek V4's compressors: ratio 4 with overlap (one program a row: the fused kernel) at
    # the indexer's 128 and the attention's 512 (also as FP8 rows); ratio 128 without (the pool
    # split over channel blocks, then the entry's norm, RoPE and store)
    cases = (
        (4, True, 128, None),
        (4, True, 512, fp8),
        (128, False, 512, None),
        (128, False, 512, fp8),
    )
    for ratio, overlap, d, fmt in cases:
        width = (2 if overlap else 1) * d
        prev = [torch.randn(slots, ratio, d) if overlap else None for _ in range(2)]
        if fmt is None:
            entries = torch.zeros(blocks, rows, d, dtype=torch.bfloat16)
        else:
            entries = torch.zeros(blocks, rows, fmt.row_bytes, dtype=torch.uint8)
        compress_decode(
            torch.randn(bs, width), torch.randn(bs, width), torch.tensor([3, 7, 130]),
            torch.tensor([0, 2, 1]), torch.arange(slots * 2).view(slots, 2) % blocks,
            pending_kv=torch.randn(slots, ratio, width),
            pending_score=torch.randn(slots, ratio, width), prev_kv=prev[0], prev_score=prev[1],
            entries=entries, maths=_compressor_maths(ratio, width, d), fp8=fmt,
        )  # fmt: skip


def _compressor_prefill() -> None:
    from sglang.kernels.ops.attention.compressor_prefill import compress_prefill
    from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat

    ratio, tokens = 4, 10
    for overlap, d, fmt in (
        (True, 128, None),
        (True, 512, Fp8RowFormat(512, 64)),
        (False, 128, None),
    ):
        width = (2 if overlap else 1) * d
        prev = [torch.randn(ratio, d) if overlap else None for _ in range(2)]
        compress_prefill(
            torch.randn(tokens, width), torch.randn(tokens, width),
            pending_kv=torch.randn(ratio, width), pending_score=torch.randn(ratio, width),
            num_pending=2, prev_kv=prev[0], prev_score=prev[1], first_block=5,
            maths=_compressor_maths(ratio, width, d), entry_dtype=torch.bfloat16, fp8=fmt,
        )  # fmt: skip


# --- the MoE launchers ---------------------------------------------------------------------------


def _moe_routing(tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=gen), ids.to(torch.int32)


def _moe_operands(e: int, h: int, i: int, k: int, tokens: int) -> tuple[torch.Tensor, ...]:
    """Random bf16 experts, their 128x128 block scales (for an FP8 cast) and a routing:
    ``(x, w13, w2, s13, s2, topk_weights, topk_ids)``."""
    x = torch.randn(tokens, h, dtype=torch.bfloat16)
    w13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16)
    w2 = torch.randn(e, h, i, dtype=torch.bfloat16)
    s13, s2 = torch.rand(e, 2 * i // 128, h // 128), torch.rand(e, h // 128, i // 128)
    return x, w13, w2, s13, s2, *_moe_routing(tokens, e, k)


def _fused_moe() -> None:
    from sglang.kernels.ops.moe import fused_moe as fm
    from sglang.kernels.ops.moe.two_launch_config import get_config

    e, h, i, k = 8, 256, 128, 2
    with _triton_path(fm):
        for tokens in (1, 200):  # one token (its own alignment) and prefill tiles
            x = torch.randn(tokens, h, dtype=torch.bfloat16)
            w13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16)
            w2 = torch.randn(e, h, i, dtype=torch.bfloat16)
            tw, ids = _moe_routing(tokens, e, k)
            cfg = get_config(tokens, e, h, i, torch.bfloat16, top_k=k)
            fm.fused_experts(x, w13, w2, tw, ids, swiglu_limit=7.0, config=cfg)
            fp8 = fm.FP8_DTYPE
            cfg8 = get_config(tokens, e, h, i, fp8, top_k=k)
            s13, s2 = torch.rand(e, 2 * i // 128, h // 128), torch.rand(e, h // 128, i // 128)
            fm.fused_experts(
                x, w13.to(fp8), w2.to(fp8), tw, ids, activation="situ", w13_scale=s13,
                w2_scale=s2, config=cfg8,
            )  # fmt: skip


def _fused_moe_mxfp4() -> None:
    from sglang.kernels.ops.moe import fused_moe as fm
    from sglang.kernels.ops.moe import fused_moe_mxfp4 as fx
    from sglang.kernels.ops.moe.mxfp4_config import default_mxfp4_config
    from sglang.kernels.ops.moe.mxfp4_weights import (
        Mxfp4MoeWeights,
        mega_moe_layout_of,
        prepare_mxfp4_moe_weights,
    )
    from sglang.test.mxfp4_experts import random_mxfp4_experts

    e, h, i, k = 8, 256, 128, 2
    w13, w2, s13, s2 = random_mxfp4_experts(e, h, i)
    prepared = prepare_mxfp4_moe_weights(w13, w2, s13, s2)
    with _triton_path(fm, fx):
        # split (one token), dot order; each also with the hidden states reordered first
        for tokens, m, reorder in ((1, 1, False), (1, 1, True), (6, 6, False), (200, 2000, True)):
            x = torch.randn(tokens, h, dtype=torch.bfloat16)
            tw, ids = _moe_routing(tokens, e, k)
            cfg = replace(default_mxfp4_config(m, 64, k), x_in_dot_order=reorder)
            fx.fused_experts_mxfp4(x, w13, w2, s13, s2, tw, ids, swiglu_limit=7.0, config=cfg)
            fx.fused_experts_mxfp4_weights(x, prepared, tw, ids, activation="situ", config=cfg)
        # DeepGEMM's MegaMoE layout (gate/up rows interleaved by 8, UTCCP scale rows)
        mega = mega_moe_layout_of(Mxfp4MoeWeights(w13, w2, s13, s2))
        for tokens, m in ((1, 1), (200, 2000)):
            x = torch.randn(tokens, h, dtype=torch.bfloat16)
            tw, ids = _moe_routing(tokens, e, k)
            cfg = default_mxfp4_config(m, 64, k)
            fx.fused_experts_mxfp4_weights(x, mega, tw, ids, swiglu_limit=7.0, config=cfg)


def _fused_moe_tma() -> None:
    from sglang.kernels.ops.moe import fused_moe as fm
    from sglang.kernels.ops.moe.grouped_gemm_tma import TmaGemmTile, TmaMoeConfig

    x, w13, w2, s13, s2, tw, ids = _moe_operands(8, 256, 256, 2, 200)
    fp8 = fm.FP8_DTYPE
    # the tuned tables' prefill tiles: bf16 paired gate-up (also warp-specialised), FP8 rescaled
    # on sorted rows; then split gate-up tiles on half-height row tiles, paired on sorted rows
    paired = TmaGemmTile(128, 64, 16, 8, 4, paired=True)
    down = TmaGemmTile(256, 64, 16, 8, 3)
    bf16_cfgs = (
        TmaMoeConfig(128, paired, down),
        TmaMoeConfig(
            128, replace(paired, warp_specialize=True), replace(down, warp_specialize=True)
        ),
        TmaMoeConfig(128, TmaGemmTile(128, 64, 16, 8, 3), down, sorted_a=True, half_tiles=True),
        TmaMoeConfig(128, paired, down, sorted_a=True),
    )
    rescaled = TmaGemmTile(128, 128, 16, 8, 3, rescale=True)
    fp8_cfgs = (
        TmaMoeConfig(128, rescaled, replace(rescaled, num_stages=4), sorted_a=True),
        TmaMoeConfig(128, TmaGemmTile(128, 128, 16, 8, 3), TmaGemmTile(128, 128, 16, 8, 4),
                     half_tiles=True),
    )  # fmt: skip
    with _triton_path(fm):
        for cfg in bf16_cfgs:
            fm.fused_experts(x, w13, w2, tw, ids, swiglu_limit=7.0, config=cfg)
        for cfg in fp8_cfgs:
            fm.fused_experts(
                x, w13.to(fp8), w2.to(fp8), tw, ids, activation="situ", w13_scale=s13,
                w2_scale=s2, config=cfg,
            )  # fmt: skip


def _mega_moe() -> None:
    from sglang.kernels.ops.moe.mega_moe_triton import mega_fused_experts

    x, w13, w2, s13, s2, tw, ids = _moe_operands(8, 256, 128, 2, 6)
    mega_fused_experts(x, w13, w2, tw, ids, num_sms=4, swiglu_limit=7.0)
    fp8 = torch.float8_e4m3fn
    mega_fused_experts(
        x, w13.to(fp8), w2.to(fp8), tw, ids, num_sms=4, activation="situ", w13_scale=s13,
        w2_scale=s2,
    )  # fmt: skip


LAUNCHERS: dict[str, Callable[[], None]] = {
    "sparse_decode_attention": _sparse_decode,
    "absorbed_mla_decode": _absorbed_decode,
    "sparse_prefill_attention": _sparse_prefill,
    "norm_rope": _norm_rope,
    "mhc_triton": _mhc,
    "fp8_block_gemm": _fp8_gemm,
    "fused_quant": _fused_quant,
    "mhc_sinkhorn_scalar": _mhc_sinkhorn_scalar,
    "compressor_decode": _compressor_decode,
    "compressor_prefill": _compressor_prefill,
    "fused_moe": _fused_moe,
    "fused_moe_mxfp4": _fused_moe_mxfp4,
    "fused_moe_tma": _fused_moe_tma,
    "mega_moe_triton": _mega_moe,
}


def digests() -> Iterator[tuple[str, str, str]]:
    """(name, digest, stripped PTX) of every kernel the launchers launch, in launch order."""
    for group, launcher in LAUNCHERS.items():
        with recorded_launches() as launches:
            launcher()
        seen: dict[str, int] = {}
        for launch in launches:
            base = f"{group}.{launch.fn.__name__}"
            seen[base] = seen.get(base, 0) + 1
            name = f"{base}.{seen[base]}"
            ptx = stripped_ptx(compile_launch(launch).asm["ptx"])
            yield name, hashlib.sha256(ptx.encode()).hexdigest()[:16], ptx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", type=Path, help="write each stripped PTX as DIR/NAME.ptx")
    parser.add_argument("--compare", type=Path, help="compare with the PTX files in DIR")
    args = parser.parse_args()
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    differ = 0
    for name, digest, ptx in digests():
        verdict = ""
        if args.compare:
            old = args.compare / f"{name}.ptx"
            same = old.is_file() and old.read_text() == ptx
            differ += not same
            verdict = "  unchanged" if same else "  CHANGED"
        if args.dump:
            (args.dump / f"{name}.ptx").write_text(ptx)
        print(f"{name:60s} {digest}{verdict}")
    print(f"triton {triton.__version__}, sm_90")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
