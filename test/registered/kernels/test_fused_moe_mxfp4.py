"""CPU checks of the MXFP4 W4A16 fused MoE (``kernels/ops/moe/fused_moe_mxfp4.py``).

- The format facts (one owner, re-exported by the engine), the inline PTX's bit trick emulated in
  numpy over every code at every nibble position and every scale byte it claims exact, the
  resident layouts (checkpoint bytes, prepared words, DeepGEMM's MegaMoE layout built by the
  engine's builder with the fake DeepGEMM) against one another, the torch oracle against a naive
  float64 loop, the refusals.
- The Triton kernels under the interpreter (a subprocess; the ``interp_`` tests skip elsewhere)
  against the oracle on fresh random experts: T in {1, 2, 7, 33, 200} (every tile rule, chunking),
  several E / k, both activations (SwiGLU with and without its clamp, SiTU), masked ids and a fully
  masked token, ``out`` / ``inplace`` / a fresh result, all three layouts (equal to each other bit
  for bit). The interpreter rounds fp32 -> bf16 casts toward zero, so exact checks use fp16
  activations (the portable dequantisation) and bf16 runs get a bf16-sized tolerance; the
  bf16-only inline-PTX path is checked here by its emulation and on the GPU by
  ``test_fused_moe_mxfp4_gpu.py``.
- The GEMM kernels compiled for sm_90 on the CPU at the default tiles: no register spills, shared
  memory within Hopper's, the bf16 multiply and warpgroup MMAs present.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from sglang.kernels.ops.moe import mxfp4_operand as mxop
from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import IN_INTERPRETER, interp_only, run_interp_tests
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_norm_err

register_cpu_ci(est_time=110)

not_in_interp = pytest.mark.skipif(IN_INTERPRETER, reason="runs in the parent process")


# --------------------------------------------------------------------------------------------
# Format facts and the PTX bit trick
# --------------------------------------------------------------------------------------------


@not_in_interp
def test_format_facts_have_one_owner() -> None:
    import sglang.kernels.ops.quant.mxfp4 as kq
    import sglang.srt.layers.quantization.mxfp4 as sq

    for name in ("dequant_mxfp4", "quant_mxfp4", "unpack_fp4", "ue8m0_to_float", "MXFP4_GROUP"):
        assert getattr(sq, name) is getattr(kq, name), name
    table = kq.e2m1_table()
    assert table[:8].tolist() == list(kq.E2M1_MAGNITUDES) and torch.equal(table[8:], -table[:8])
    # Low nibble = even element; scale byte s = 2**(s-127).
    packed = torch.tensor([[0x21, 0xF7]], dtype=torch.uint8)
    vals = kq.unpack_fp4(packed)
    assert vals.tolist() == [[0.5, 1.0, 6.0, -6.0]]
    deq = kq.dequant_mxfp4(packed.repeat(1, 8), torch.tensor([[125]], dtype=torch.uint8))
    assert deq[0, :4].float().tolist() == [0.125, 0.25, 1.5, -1.5]


def test_dequant_in_pieces_equals_one_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight stack is dequantised a few rows at a time (bounded temporaries); pieces that split
    rows unevenly, int8 bytes and e8m0 scales give the same values as a single piece, and those
    equal the format's definition written out elementwise."""
    import sglang.kernels.ops.quant.mxfp4 as kq

    g = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (3, 5, 32), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 5, 2), dtype=torch.uint8, generator=g)
    whole = kq.dequant_mxfp4(packed, scales, torch.float32)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()
    want = kq.e2m1_table()[codes] * torch.exp2(scales.float() - kq.UE8M0_BIAS).repeat_interleave(
        kq.MXFP4_GROUP, dim=-1
    )
    assert torch.equal(whole, want)
    monkeypatch.setattr(kq, "DEQUANT_CHUNK_VALUES", 64 * 3)  # 3 rows of 64 values a piece
    pieces = kq.dequant_mxfp4(
        packed.view(torch.int8), scales.view(torch.float8_e8m0fnu), torch.float32
    )
    assert pieces.shape == (3, 5, 64) and torch.equal(pieces, whole)
    empty = kq.dequant_mxfp4(packed[:0], scales[:0])
    assert empty.shape == (0, 5, 64) and empty.dtype == torch.bfloat16


def _bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 patterns -> float64 values, subnormals included."""
    as_f32 = (bits.astype(np.uint32) << 16).view(np.float32)
    return as_f32.astype(np.float64)


def _emulate_byte_ptx(packed: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """The PTX of ``e2m1_byte_ptx`` op by op (its tables), in numpy: uint8 [N, 4] (one
    invocation's four bytes), scale bytes [N, 4] -> float64 [N, 4, 2]: the low- and high-nibble
    values of each byte, including the 2**-62 offset."""
    from sglang.kernels.ops.moe import mxfp4_operand as op

    s = np.minimum(scale_bytes.astype(np.int64), op.ASM_SCALE_MAX_BYTE)
    mult = _bf16_bits_to_float(((s + op.ASM_SCALE_EXP_OFFSET) << 7).astype(np.uint16))
    word = np.zeros(packed.shape[0], dtype=np.uint32)
    for i in range(4):
        word |= packed[:, i].astype(np.uint32) << np.uint32(8 * i)
    out = np.zeros((packed.shape[0], 4, 2))
    for spread, sel in enumerate(op.E2M1_SPREAD_SELECTORS):
        # prmt with a zero second operand: nibble i of the selector picks result byte i
        src = np.zeros_like(word)
        for i in range(4):
            pick = (sel >> (4 * i)) & 0xF  # bytes 0-3 of the word, 4-7 of the zero operand
            if pick < 4:
                src |= ((word >> np.uint32(8 * pick)) & np.uint32(0xFF)) << np.uint32(8 * i)
        for kind, (mask, factor) in enumerate(op.E2M1_NIBBLE_PAIRS):
            t = ((src & np.uint32(mask)).astype(np.uint64) * factor) & 0xFFFFFFFF
            t = t.astype(np.uint32) & np.uint32(op.BF16_E2M1_BITS)
            for half in range(2):  # the two bytes of this spread: 2*spread + half
                byte = 2 * spread + half
                bits = ((t >> np.uint32(16 * half)) & np.uint32(0xFFFF)).astype(np.uint16)
                prod = _bf16_bits_to_float(bits) * mult[:, byte]
                # mul.rn.bf16x2: a 2-bit significand times a power of two is exact as long as it
                # is a normal bf16; check it is, so rounding never enters.
                nz = prod != 0
                assert np.all(np.abs(prod[nz]) >= 2.0**-126) and np.all(np.abs(prod) < 2.0**127)
                out[:, byte, kind] = prod
    return out


@not_in_interp
def test_byte_ptx_trick_is_exact() -> None:
    """Every code in both nibbles of every byte of an invocation, with every scale byte from
    2**-63 to 2**63 (each byte its own): the PTX's bf16 values times 2**62 are the E2M1 values
    times the scale."""
    from sglang.kernels.ops.moe import mxfp4_operand as op
    from sglang.kernels.ops.quant.mxfp4 import e2m1_table

    ptx = op.e2m1_byte_ptx()
    assert ptx.count("mul.rn.bf16x2") == 4 and ptx.count("prmt.b32") == 2
    table = e2m1_table().double().numpy()
    rng = np.random.default_rng(0)
    every = np.arange(256, dtype=np.uint8)
    packed = np.stack([np.roll(every, 17 * i) for i in range(4)], axis=1)  # [256, 4]
    packed = np.concatenate([packed, rng.integers(0, 256, (256, 4), dtype=np.uint8)])
    lo, hi = table[packed & 0xF], table[packed >> 4]
    for first in range(127 - 63, 127 + 64, 8):
        sb = first + rng.integers(0, 8, packed.shape)
        sb = np.minimum(sb, 127 + 63)
        got = _emulate_byte_ptx(packed, sb) * 2.0**op.ASM_ACC_EXP
        scale = 2.0 ** (sb - 127.0)
        assert np.array_equal(got[..., 0], lo * scale), first
        assert np.array_equal(got[..., 1], hi * scale), first


# --------------------------------------------------------------------------------------------
# Resident layouts
# --------------------------------------------------------------------------------------------


def _experts(e: int, h: int, i: int, seed: int) -> tuple[torch.Tensor, ...]:
    from sglang.test.mxfp4_experts import random_mxfp4_experts

    return random_mxfp4_experts(e, h, i, seed=seed)


def _mega_from_engine_builder(w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor,
                              s2: torch.Tensor) -> Any:  # fmt: skip
    """The MegaMoE layout as the engine builds it (``build_mega_moe_experts_weights`` with the fake
    DeepGEMM's ``transform_sf_into_required_layout``), wrapped for the kernels."""
    from sglang.kernels.ops.moe.mxfp4_weights import mega_moe_mxfp4_weights
    from sglang.srt.layers.moe.mega_moe_weights import build_mega_moe_experts_weights
    from sglang.test.fake_deep_gemm import FakeDeepGemmGemms

    l1, l2 = build_mega_moe_experts_weights(FakeDeepGemmGemms(), w13, w2, s13, s2)
    return mega_moe_mxfp4_weights(l1, l2)


@not_in_interp
def test_layouts_hold_the_same_experts() -> None:
    from sglang.kernels.ops.moe.mxfp4_weights import (
        MEGA_MOE_LAYOUT,
        Mxfp4MoeWeights,
        mega_moe_layout_of,
        prepare_mxfp4_moe_weights,
    )
    from sglang.kernels.ops.quant.mxfp4 import dequant_mxfp4

    e, h, i = 3, 256, 384
    w13, w2, s13, s2 = _experts(e, h, i, seed=1)
    plain = Mxfp4MoeWeights(w13, w2, s13, s2)
    want13, want2 = dequant_mxfp4(w13, s13), dequant_mxfp4(w2, s2)
    prepared = prepare_mxfp4_moe_weights(w13, w2, s13.view(torch.float8_e8m0fnu), s2)
    mega = _mega_from_engine_builder(w13, w2, s13, s2)
    for name, wts in (("plain", plain), ("prepared", prepared), ("mega", mega),
                      ("mega (torch)", mega_moe_layout_of(plain))):  # fmt: skip
        got13, got2 = wts.dequantized()
        assert torch.equal(got13, want13) and torch.equal(got2, want2), name
        assert wts.nbytes <= 1.05 * plain.nbytes, name
        sub13, sub2 = wts.dequantized(torch.float32, torch.tensor([2, 0]))
        assert torch.equal(sub13, want13[[2, 0]].float()) and torch.equal(
            sub2, want2[[2, 0]].float()
        )
    assert mega.layout == MEGA_MOE_LAYOUT
    # The torch re-layout is the engine builder's, byte for byte.
    ours = mega_moe_layout_of(plain)
    for a, b in zip(ours.kernel_operands, mega.kernel_operands, strict=True):
        assert torch.equal(a, b)
    assert prepared.w13_scale.stride(1) == 1, "prepared scale words are MN-major"


@not_in_interp
def test_bad_inputs_are_refused_by_name() -> None:
    from sglang.kernels.ops.moe.fused_moe_mxfp4 import fused_experts_mxfp4
    from sglang.kernels.ops.moe.mxfp4_config import Mxfp4GemmTile, Mxfp4MoeConfig
    from sglang.kernels.ops.moe.mxfp4_weights import Mxfp4MoeWeights

    e, h, i = 2, 256, 128
    w13, w2, s13, s2 = _experts(e, h, i, seed=2)
    x = torch.randn(3, h).bfloat16()
    ids = torch.zeros(3, 2, dtype=torch.int32)
    tw = torch.ones(3, 2)
    with pytest.raises(ValueError, match="multiple of 128"):
        Mxfp4MoeWeights(w13[:, :, :96], w2[:, :192], s13[:, :, :6], s2[:, :192])
    with pytest.raises(TypeError, match="w2"):
        Mxfp4MoeWeights(w13, w2.float(), s13, s2)
    with pytest.raises(ValueError, match="w13_scale"):
        Mxfp4MoeWeights(w13, w2, s13[:, :, :4], s2)
    with pytest.raises(TypeError, match="w2_scale"):
        Mxfp4MoeWeights(w13, w2, s13, s2.float())
    with pytest.raises(ValueError, match="bf16 or fp16"):
        fused_experts_mxfp4(x.float(), w13, w2, s13, s2, tw, ids)
    with pytest.raises(ValueError, match="columns"):
        fused_experts_mxfp4(x[:, :128], w13, w2, s13, s2, tw, ids)
    with pytest.raises(ValueError, match="out must match"):
        fused_experts_mxfp4(x, w13, w2, s13, s2, tw, ids, out=torch.empty(3, h))
    from sglang.kernels.ops.moe.mxfp4_config import mxfp4_config_fits

    tile = Mxfp4GemmTile(64, 1, 4, 4)
    assert mxfp4_config_fits(Mxfp4MoeConfig(16, tile, tile), h, i) is None
    assert "block_m" in (mxfp4_config_fits(Mxfp4MoeConfig(8, tile, tile), h, i) or "")
    assert "kernel" in (mxfp4_config_fits(Mxfp4MoeConfig(16, tile, tile, kernel="x"), h, i) or "")
    one_warp = Mxfp4GemmTile(16, 1, 1, 4)
    assert "warps" in (mxfp4_config_fits(Mxfp4MoeConfig(16, one_warp, one_warp), h, i) or "")
    split = Mxfp4MoeConfig(16, one_warp, one_warp, kernel="split")
    assert mxfp4_config_fits(split, h, i) is None
    big = Mxfp4GemmTile(256, 1, 4, 8)
    assert "divide" in (mxfp4_config_fits(Mxfp4MoeConfig(16, big, tile), h, i) or "")
    assert "shared memory" in (mxfp4_config_fits(Mxfp4MoeConfig(64, tile, big), 4096, 2048) or "")
    assert "registers" in (
        mxfp4_config_fits(Mxfp4MoeConfig(128, Mxfp4GemmTile(128, 1, 4, 2), tile), 4096, 2048) or ""
    )


@not_in_interp
@pytest.mark.parametrize("shape", [(256, 6, 4096, 2048), (384, 16, 3584, 3072)], ids=["dsv4", "k3"])
def test_default_configs_fit_the_model_shapes(shape: tuple[int, int, int, int]) -> None:
    from sglang.kernels.ops.moe.mxfp4_config import default_mxfp4_config, mxfp4_config_fits

    e, k, h, i = shape
    for m in (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192):
        cfg = default_mxfp4_config(m, e, k)
        assert mxfp4_config_fits(cfg, h, i) is None, (m, cfg)


@not_in_interp
def test_tuned_table_round_trips(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table as the tuner writes it loads back into the same configs, sorted by M."""
    import json

    import sglang.kernels.ops.moe.mxfp4_config as mc

    cfgs = [mc.default_mxfp4_config(m, 256, 6) for m in (8192, 1)]
    name = mc.table_name(256, 4096, 2048, 6, mc.DTYPE_KEY, "Some GPU")
    data = {"buckets": [{"m": m, "config": mc.config_to_dict(c)} for m, c in zip((8192, 1), cfgs)]}
    (tmp_path / name).write_text(json.dumps(data))
    monkeypatch.setattr(mc, "CONFIG_DIR", tmp_path)
    mc.load_mxfp4_table.cache_clear()
    try:
        assert mc.load_mxfp4_table(name) == ((1, cfgs[1]), (8192, cfgs[0]))
        assert mc.load_mxfp4_table("missing.json") is None
    finally:
        mc.load_mxfp4_table.cache_clear()


# --------------------------------------------------------------------------------------------
# The torch oracle
# --------------------------------------------------------------------------------------------


def _act64(gate_up: torch.Tensor, activation: str, limit: float | None) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "situ":
        return 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * 25.0 * torch.tanh(up / 25.0)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate) * up


@not_in_interp
@pytest.mark.parametrize("activation,limit", [("swiglu", 0.75), ("situ", None)])
def test_oracle_matches_a_float64_loop(activation: str, limit: float | None) -> None:
    from sglang.kernels.ops.moe.fused_moe_mxfp4 import (
        fused_experts_mxfp4,
        fused_experts_mxfp4_torch,
    )
    from sglang.kernels.ops.quant.mxfp4 import dequant_mxfp4
    from sglang.test.mxfp4_experts import random_routing

    e, k, h, i = 5, 2, 256, 128
    w13, w2, s13, s2 = _experts(e, h, i, seed=3)
    x, tw, ids = random_routing(6, h, e, k, seed=4, masked=0.2)
    ids[3] = -1
    got = fused_experts_mxfp4_torch(x, w13, w2, s13, s2, tw, ids, activation=activation,
                                    swiglu_limit=limit)  # fmt: skip
    w13d, w2d = dequant_mxfp4(w13, s13, torch.float64), dequant_mxfp4(w2, s2, torch.float64)
    want = torch.zeros(6, h, dtype=torch.float64)
    for t in range(6):
        for s in range(k):
            ex = int(ids[t, s])
            if ex >= 0:
                hmid = _act64(w13d[ex] @ x[t].double(), activation, limit)
                want[t] += float(tw[t, s]) * (w2d[ex] @ hmid)
    assert (got[3] == 0).all() and torch.isfinite(got).all()
    assert rel_norm_err(got, want) < 1e-2
    # Off CUDA (no interpreter) the entry point is the oracle.
    out = torch.empty_like(x)
    assert fused_experts_mxfp4(x, w13, w2, s13, s2, tw, ids, activation=activation,
                               swiglu_limit=limit, out=out) is out  # fmt: skip
    assert torch.equal(out, got)


# --------------------------------------------------------------------------------------------
# Under the interpreter
# --------------------------------------------------------------------------------------------


@not_in_interp
def test_triton_kernels_under_interpreter() -> None:
    run_interp_tests(__file__, timeout=900)


@triton.jit
def _assembly_kernel(packed_ptr, sb_ptr, a_ptr, b_ptr, pos_ptr, ROWS: tl.constexpr):
    # The weight tile as the kernels build it (a), and the physical tile put in dot order by the
    # activations' reordering (b), from the same bytes; and dot_order_position of 256 columns.
    r = tl.arange(0, ROWS)
    packed = tl.load(packed_ptr + r[:, None] * 64 + tl.arange(0, 64)[None, :])
    scales = tl.load(sb_ptr + r[:, None] * 4 + tl.arange(0, 4)[None, :])
    a = mxop.weight_tile(packed, scales, ROWS, tl.float32, False)
    lo, hi = mxop.e2m1_nibbles(packed, mxop.byte_scales(scales, ROWS), tl.float32)
    b = mxop.to_dot_order(tl.join(lo, hi).reshape(ROWS, 128), ROWS, 128)
    out = r[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(a_ptr + out, a)
    tl.store(b_ptr + out, b)
    cols = tl.arange(0, 256)
    tl.store(pos_ptr + cols, mxop.dot_order_position(cols, 128))


@interp_only
def test_interp_weight_tile_is_in_dot_order() -> None:
    """The weight tile (low and high nibbles joined and permuted) equals the physical tile put
    in dot order as the activations are, and ``dot_order_position`` is where ``to_dot_order``
    puts each column."""
    from sglang.kernels.ops.quant.mxfp4 import dequant_mxfp4

    rows = 16
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (rows, 64), generator=g, dtype=torch.uint8)
    sb = torch.randint(120, 130, (rows, 4), generator=g, dtype=torch.uint8)
    a = torch.empty(rows, 128)
    b = torch.empty(rows, 128)
    pos = torch.empty(256, dtype=torch.int32)
    _assembly_kernel[(1,)](packed, sb, a, b, pos, ROWS=rows)
    assert torch.equal(a, b)
    # dot_order_position inverts to_dot_order: a[:, pos[p]] is physical column p.
    assert torch.equal(a[:, pos[:128].long()], dequant_mxfp4(packed, sb, torch.float32))
    assert torch.equal(pos[128:], pos[:128] + 128)
    assert sorted(pos[:128].tolist()) == list(range(128))


def _layout_weights(kind: str, w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor,
                    s2: torch.Tensor) -> Any:  # fmt: skip
    from sglang.kernels.ops.moe.mxfp4_weights import Mxfp4MoeWeights, prepare_mxfp4_moe_weights

    if kind == "plain":
        return Mxfp4MoeWeights(w13, w2, s13, s2)
    if kind == "prepared":
        return prepare_mxfp4_moe_weights(w13, w2, s13, s2)
    return _mega_from_engine_builder(w13, w2, s13, s2)


# (tokens, experts, top_k, hidden, inter, activation, limit, layouts, output mode, dtype, tiles):
# tiles None = the default rule (one-token decode on the split kernel, 32-row, 128-row prefill
# tiles with the hidden states put in dot order first); "wide" = 128-column tiles (fewer
# interpreted programs); "split" / "split_x" = the split kernel (SPLIT_TILES).
INTERP_CASES = [
    (1, 8, 4, 256, 128, "swiglu", 0.9, ("plain", "mega"), "out", torch.float16, None),
    (2, 6, 3, 128, 256, "situ", None, ("plain",), "inplace", torch.float16, "wide"),
    (7, 5, 2, 256, 128, "swiglu", None, ("prepared", "mega"), "new", torch.float16, "wide"),
    (33, 6, 3, 128, 128, "situ", None, ("plain",), "out", torch.float16, None),
    (200, 2, 1, 128, 128, "swiglu", 0.9, ("plain",), "out", torch.float16, None),
    (7, 5, 2, 128, 128, "swiglu", 0.9, ("plain",), "out", torch.bfloat16, "wide"),
    # the split kernel: hidden states reordered in GEMM 1 (T=1 takes it by the default rule) and
    # ahead of it, 16- and 32-row tiles, every layout, bf16
    (5, 6, 3, 128, 128, "situ", None, ("prepared", "mega"), "new", torch.float16, "split"),
    (9, 4, 2, 128, 256, "swiglu", 0.9, ("mega", "plain"), "out", torch.float16, "split_x"),
    (6, 4, 2, 128, 128, "swiglu", None, ("plain",), "inplace", torch.bfloat16, "split"),
]
WIDE = (16, (128, 1, 4, 2), (128, 1, 4, 2))
SPLIT_TILES = {"split": ((8, 1, 1, 2), (32, 1, 2, 3)), "split_x": ((16, 1, 2, 2), (16, 1, 1, 2))}


@interp_only
@pytest.mark.parametrize("case", INTERP_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-{c[5]}")
def test_interp_fused_experts_mxfp4(case: tuple[Any, ...]) -> None:
    from sglang.kernels.ops.moe.fused_moe_mxfp4 import (
        fused_experts_mxfp4_weights,
        fused_experts_mxfp4_weights_torch,
    )
    from sglang.kernels.ops.moe.mxfp4_config import Mxfp4GemmTile, Mxfp4MoeConfig
    from sglang.test.mxfp4_experts import random_routing

    tokens, e, k, h, i, activation, limit, layouts, mode, dtype, tiles = case
    cfg = None
    if tiles == "wide":
        cfg = Mxfp4MoeConfig(WIDE[0], Mxfp4GemmTile(*WIDE[1]), Mxfp4GemmTile(*WIDE[2]))
    elif tiles in SPLIT_TILES:
        g1, g2 = SPLIT_TILES[tiles]
        cfg = Mxfp4MoeConfig(16, Mxfp4GemmTile(*g1), Mxfp4GemmTile(*g2),
                             x_in_dot_order=tiles == "split_x", kernel="split")  # fmt: skip
    w13, w2, s13, s2 = _experts(e, h, i, seed=tokens)
    x, tw, ids = random_routing(tokens, h, e, k, seed=tokens + 1, dtype=dtype, masked=0.15)
    if tokens > 2:
        ids[tokens // 2] = -1  # a fully masked token comes out as zeros
    kw: dict[str, Any] = {"activation": activation, "swiglu_limit": limit}
    plain = _layout_weights("plain", w13, w2, s13, s2)
    want = fused_experts_mxfp4_weights_torch(x, plain, tw, ids, **kw)
    kw["config"] = cfg
    assert torch.isfinite(want).all() and want.abs().sum() > 0
    results = []
    for kind in layouts:
        weights = _layout_weights(kind, w13, w2, s13, s2)
        hidden = x.clone()
        if mode == "out":
            out = torch.full_like(x, float("nan"))
            got = fused_experts_mxfp4_weights(hidden, weights, tw, ids, out=out, **kw)
            assert got.data_ptr() == out.data_ptr()
        elif mode == "inplace":
            got = fused_experts_mxfp4_weights(hidden, weights, tw, ids, inplace=True, **kw)
            assert got.data_ptr() == hidden.data_ptr()
        else:
            got = fused_experts_mxfp4_weights(hidden, weights, tw, ids, **kw)
            assert got.data_ptr() != hidden.data_ptr()
            assert torch.equal(hidden, x), "the input must not be written"
        assert torch.isfinite(got).all(), kind
        if tokens > 2:
            assert (got[tokens // 2] == 0).all()
        # fp16: only the summation order differs from the oracle; the interpreter truncates bf16.
        tol = 2e-3 if dtype == torch.float16 else 3e-2
        assert rel_norm_err(got, want) < tol, (kind, rel_norm_err(got, want))
        results.append(got)
    for kind, got in zip(layouts[1:], results[1:], strict=True):
        assert torch.equal(got, results[0]), f"{kind} differs from {layouts[0]}"


@interp_only
def test_interp_chunks_and_forced_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill-size tiles on a small batch in chunks smaller than it (each chunk aligned and run
    on its own) equal the decode tiles without chunks."""
    import sglang.kernels.ops.moe.fused_moe_mxfp4 as fm
    from sglang.kernels.ops.moe.mxfp4_config import Mxfp4GemmTile, Mxfp4MoeConfig
    from sglang.test.mxfp4_experts import random_routing

    e, k, h, i = 3, 2, 128, 128
    w13, w2, s13, s2 = _experts(e, h, i, seed=9)
    x, tw, ids = random_routing(8, h, e, k, seed=10, dtype=torch.float16, masked=0.1)
    decode = Mxfp4MoeConfig(16, Mxfp4GemmTile(32, 1, 4, 2), Mxfp4GemmTile(128, 2, 4, 2))
    want = fm.fused_experts_mxfp4(x, w13, w2, s13, s2, tw, ids, config=decode)
    monkeypatch.setattr(fm, "CHUNK_TOKENS", 5)
    prefill = Mxfp4MoeConfig(32, Mxfp4GemmTile(128, 4, 4, 2), Mxfp4GemmTile(128, 4, 4, 2), True)
    got = fm.fused_experts_mxfp4(x, w13, w2, s13, s2, tw, ids, config=prefill)
    assert rel_norm_err(got, want) < 1e-3
    with pytest.raises(ValueError, match="cannot run"):
        bad = Mxfp4MoeConfig(16, Mxfp4GemmTile(96, 1, 4, 2), decode.gemm2)
        fm.fused_experts_mxfp4(x, w13, w2, s13, s2, tw, ids, config=bad)


# --------------------------------------------------------------------------------------------
# Compiled for sm_90
# --------------------------------------------------------------------------------------------

_IDS = {"sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "ntpp_ptr": "*i32"}
_STRIDES = ("stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_wsk", "stride_om")


def compile_mxfp4_gemm(gate_up: bool, cfg: Any, layout: Any) -> Any:
    """One of the two GEMM kernels for sm_90, at ``cfg``'s tiles, bf16 with the inline PTX."""
    from sglang.kernels.ops.moe import fused_moe_mxfp4 as fm
    from sglang.test.sm90_compile import compile_sm90

    tile = cfg.gemm1 if gate_up else cfg.gemm2
    common = {"num_slots": "i32", "num_m_blocks": "i32", "n_cols": "i32", "k_dim": "i32"}
    strides = dict.fromkeys(_STRIDES, "i32")
    const: dict[str, Any] = {
        "SCALE_UTCCP": layout.scale_utccp, "ASM": True, "DOT_F32": False,
        "BLOCK_M": cfg.block_m, "BLOCK_N": tile.block_n, "GROUP_M": tile.group_m,
    }  # fmt: skip
    if gate_up:
        sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": "*bf16", **_IDS,
               **common, "top_k": "i32", "stride_xm": "i32", **strides,
               "limit": "fp32"}  # fmt: skip
        const.update(ACTIVATION=0, HAS_LIMIT=True, X_IN_DOT_ORDER=cfg.x_in_dot_order,
                     GATE_UP_GRANULE=layout.gate_up_granule)  # fmt: skip
        fn = fm._mxfp4_gemm1_kernel
    else:
        sig = {"a_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": "*bf16",
               "topk_weights_ptr": "*fp32", **_IDS, **common, "stride_am": "i32",
               **strides}  # fmt: skip
        fn = fm._mxfp4_gemm2_kernel
    aligned = tuple(n for n, t in sig.items() if t.startswith("*")) + (
        "n_cols", "k_dim", "stride_xm" if gate_up else "stride_am", "stride_we", "stride_wn",
        "stride_wse", "stride_om",
    )  # fmt: skip
    return compile_sm90(fn, sig, const, tile.num_warps, tile.num_stages, aligned)


@pytest.mark.skipif(IN_INTERPRETER, reason="compiles for the GPU; the interpreter never does")
@pytest.mark.parametrize("m", [512, 8192])
def test_default_tiles_compile_for_sm90(m: int) -> None:
    """The dot-order kernels' default tiles of large decode batches (M=512, 16-row tiles) and
    prefill (M=8192, 128-row tiles) at DeepSeek V4's shape through Triton's whole compiler for
    sm_90 and ptxas: no spills, shared memory within Hopper's 227 KB, bf16x2 multiplies (the
    inline PTX) and warpgroup MMAs."""
    pytest.importorskip("triton.backends.nvidia")
    from sglang.kernels.ops.moe.mxfp4_config import SMEM_BYTES, default_mxfp4_config
    from sglang.kernels.ops.moe.mxfp4_weights import MEGA_MOE_LAYOUT, PLAIN_LAYOUT
    from sglang.test.sm90_compile import ptxas_usage

    cfg = default_mxfp4_config(m, 256, 6)
    assert cfg.kernel == "dot_order"
    # decode: both GEMMs (GEMM 1 on the MegaMoE layout's flags); prefill: GEMM 1, the one with
    # the most registers (two 128 x 128 accumulators)
    cases = [(True, MEGA_MOE_LAYOUT), (False, PLAIN_LAYOUT)] if m == 512 else [(True, PLAIN_LAYOUT)]
    for gate_up, layout in cases:
        kernel = compile_mxfp4_gemm(gate_up, cfg, layout)
        usage = ptxas_usage(kernel)
        ptx = kernel.asm["ptx"]
        what = f"{'gate_up' if gate_up else 'down'} M={m} {cfg}"
        assert usage.spill_bytes == 0, (what, usage)
        assert usage.shared_bytes <= SMEM_BYTES, (what, usage)
        assert "mul.rn.bf16x2" in ptx and "wgmma.mma_async" in ptx, what


def compile_mxfp4_split_gemm(gate_up: bool, cfg: Any, layout: Any) -> Any:
    """One GEMM of the split kernel for sm_90, at ``cfg``'s tiles, bf16 with the inline PTX."""
    from sglang.kernels.ops.moe import mxfp4_split_gemm as sg
    from sglang.test.sm90_compile import compile_sm90

    tile = cfg.gemm1 if gate_up else cfg.gemm2
    ints = ("num_slots", "num_m_blocks", "n_cols", "k_dim", "a_row_div", "stride_am", *_STRIDES)
    sig = {"a_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*i32", "out_ptr": "*bf16",
           "topk_weights_ptr": "*fp32", **_IDS, **dict.fromkeys(ints, "i32"),
           "limit": "fp32"}  # fmt: skip
    const = {
        "GATE_UP": gate_up, "ACTIVATION": 0, "HAS_LIMIT": True,
        "A_IN_ORDER": cfg.x_in_dot_order or not gate_up,
        "GATE_UP_GRANULE": layout.gate_up_granule if gate_up else 0,
        "SCALE_UTCCP": layout.scale_utccp, "ASM": True, "DOT_F32": False,
        "BLOCK_M": cfg.block_m, "BLOCK_N": tile.block_n, "GROUP_M": tile.group_m,
    }  # fmt: skip
    aligned = tuple(n for n, t in sig.items() if t.startswith("*")) + (
        "n_cols", "k_dim", "stride_am", "stride_we", "stride_wn", "stride_om",
    )  # fmt: skip
    return compile_sm90(
        sg._mxfp4_split_gemm_kernel, sig, const, tile.num_warps, tile.num_stages, aligned
    )


@pytest.mark.skipif(IN_INTERPRETER, reason="compiles for the GPU; the interpreter never does")
def test_split_decode_tiles_compile_for_sm90() -> None:
    """The split kernel at the decode default (M=1) at DeepSeek V4's shape and at a 32-row tile on
    two warps (``mma.sync``), each GEMM: no spills, shared memory within Hopper's and within the
    fit estimate plus its reserve, every loop load an asynchronous copy (no synchronous global load
    past the prologue's few), the bf16x2 multiplies of the inline PTX."""
    pytest.importorskip("triton.backends.nvidia")
    from sglang.kernels.ops.moe.mxfp4_config import (
        SMEM_BYTES,
        SMEM_RESERVE,
        Mxfp4GemmTile,
        Mxfp4MoeConfig,
        default_mxfp4_config,
        gemm_smem_bytes,
    )
    from sglang.kernels.ops.moe.mxfp4_weights import MEGA_MOE_LAYOUT, PLAIN_LAYOUT
    from sglang.test.sm90_compile import ptxas_usage

    decode = default_mxfp4_config(1, 256, 6)
    assert decode.kernel == "split"
    narrow = Mxfp4MoeConfig(16, Mxfp4GemmTile(16, 1, 2, 6), Mxfp4GemmTile(32, 1, 2, 6),
                            kernel="split")  # fmt: skip
    for cfg, gate_up, layout in ((decode, True, MEGA_MOE_LAYOUT), (decode, False, PLAIN_LAYOUT),
                                 (narrow, True, PLAIN_LAYOUT)):  # fmt: skip
        kernel = compile_mxfp4_split_gemm(gate_up, cfg, layout)
        usage = ptxas_usage(kernel)
        ptx = kernel.asm["ptx"]
        tile = cfg.gemm1 if gate_up else cfg.gemm2
        what = f"split {'gate_up' if gate_up else 'down'} {cfg}"
        assert usage.spill_bytes == 0, (what, usage)
        estimate = gemm_smem_bytes(tile, cfg.block_m, gate_up, cfg.x_in_dot_order, True)
        assert usage.shared_bytes <= min(SMEM_BYTES, estimate + SMEM_RESERVE), (what, usage)
        assert "mul.rn.bf16x2" in ptx and "cp.async" in ptx, what
        assert ptx.count("ld.global") <= 12, (what, "synchronous loads in the loop?")


if __name__ == "__main__":
    run_this_file(__file__)
