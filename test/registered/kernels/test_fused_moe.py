"""CPU checks of the fused-MoE pieces: expert alignment, FP8 block quantisation, the torch
reference against a naive float64 loop, and the Triton kernels under Triton's interpreter.

The interpreter must be switched on before triton is imported, so the ``test_interp_*`` tests run
in a subprocess (``test_triton_kernels_under_interpreter`` starts it) and skip otherwise. Two
interpreter limits shape them (Triton 3.9): a bf16 ``tl.dot`` returns garbage and fp32->bf16/fp8
casts do not round to nearest, so the kernels are checked with fp32 activations there, FP8 GEMMs
take torch-quantised activations, and the quantiser's own kernel tolerates the interpreter's
fp8 rounding slip (a value that rounds up to the next power of two lands on half of it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.hang_guard import hang_guard
from sglang.test.interpreter import IN_INTERPRETER, interp_only, run_interp_tests
from sglang.test.moe_cases import ACTS, make_moe
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_norm_err

register_cpu_ci(est_time=60)


# --------------------------------------------------------------------------------------------
# Alignment
# --------------------------------------------------------------------------------------------


def check_alignment(
    topk_ids: torch.Tensor,
    block_m: int,
    num_experts: int,
    result: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    from sglang.kernels.ops.moe.align import padded_size

    sorted_ids, expert_ids, ntpp = (t.cpu() for t in result)
    flat = topk_ids.reshape(-1).long().cpu()
    sentinel = flat.numel()
    length = padded_size(flat.numel(), block_m, num_experts)
    assert sorted_ids.dtype == expert_ids.dtype == ntpp.dtype == torch.int32
    assert sorted_ids.shape == (length,) and expert_ids.shape == (length // block_m,)
    assert length % block_m == 0
    total = int(ntpp.item())
    assert total % block_m == 0 and total <= length
    assert (sorted_ids[total:] == sentinel).all(), "unused tail must hold the sentinel"
    assert (expert_ids[total // block_m :] == -1).all(), "unused blocks must be marked -1"

    seen = torch.zeros(sentinel, dtype=torch.int64)
    blocks_of = torch.zeros(num_experts, dtype=torch.int64)
    for b in range(total // block_m):
        e = int(expert_ids[b])
        assert 0 <= e < num_experts
        blocks_of[e] += 1
        rows = sorted_ids[b * block_m : (b + 1) * block_m].long()
        real = rows[rows != sentinel]
        assert ((real >= 0) & (real < sentinel)).all()
        assert (flat[real] == e).all(), f"block {b} of expert {e} holds another expert's rows"
        seen[real] += 1
    valid = (flat >= 0) & (flat < num_experts)
    assert (seen[valid] == 1).all(), "every routed (token, slot) must appear exactly once"
    assert (seen[~valid] == 0).all(), "masked slots must be skipped"
    counts = torch.bincount(flat[valid], minlength=num_experts)
    assert torch.equal(blocks_of, (counts + block_m - 1) // block_m), "segments padded to block_m"
    # Each expert's blocks are contiguous.
    used = expert_ids[: total // block_m].long()
    changes = (used[1:] != used[:-1]).sum().item() if used.numel() else 0
    assert changes == max(int((counts > 0).sum()) - 1, 0)


def check_half_tiles(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, result: tuple[torch.Tensor, ...]
) -> None:
    """``moe_align_half_tiles``: an alignment to ``block_m / 2``, and a tile table whose first
    ``num_tiles`` tiles cover every used row exactly once, in order, each inside one expert's
    segment, ``block_m`` rows high except an expert's last tile when half of it covers the rest."""
    half = block_m // 2
    check_alignment(topk_ids, half, num_experts, result[:3])
    _, expert_ids, ntpp, table, num_tiles = (t.cpu() for t in result)
    n = int(num_tiles.item())
    assert table.dtype == num_tiles.dtype == torch.int32
    assert table.shape == (expert_ids.shape[0], 3)
    assert torch.equal(
        table[n:], torch.tensor([0, -1, 0], dtype=torch.int32).expand(len(table) - n, 3)
    )
    covered = torch.zeros(int(ntpp.item()) // half, dtype=torch.int64)
    next_row = 0
    for t in range(n):
        row0, e, is_half = (int(v) for v in table[t])
        rows = half if is_half else block_m
        assert row0 == next_row and row0 % half == 0, f"tile {t} does not follow the previous"
        blocks = expert_ids[row0 // half : (row0 + rows) // half]
        assert blocks.numel() == rows // half and (blocks == e).all(), f"tile {t} leaves expert {e}"
        covered[row0 // half : (row0 + rows) // half] += 1
        last = t + 1 == n or int(table[t + 1, 1]) != e
        assert not is_half or last, f"tile {t}: only an expert's last tile may be half"
        if last:  # the segment ends here, and a whole tile would have run past it
            end = row0 + rows
            assert end == len(expert_ids) * half or int(expert_ids[end // half]) != e
        next_row = row0 + rows
    assert (covered == 1).all() and next_row == int(ntpp.item())


ALIGN_CASES = [
    # (tokens, top_k, experts, block_m, fraction of masked slots)
    (1, 6, 256, 16, 0.0),
    (7, 4, 8, 4, 0.2),
    (33, 3, 5, 16, 0.3),
    (0, 2, 4, 16, 0.0),
    (64, 8, 64, 32, 0.1),
    (5, 2, 3, 64, 1.0),
]


def _random_ids(tokens: int, k: int, experts: int, masked: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = (
        torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        if tokens
        else (torch.empty(0, k, dtype=torch.int64))
    )
    if masked:
        drop = torch.rand(ids.shape, generator=g) < masked
        ids = torch.where(drop, -1, ids)
    return ids.to(torch.int32)


@pytest.mark.parametrize("case", ALIGN_CASES)
def test_align_torch(case: tuple[int, int, int, int, float]) -> None:
    from sglang.kernels.ops.moe.align import moe_align_block_size

    tokens, k, experts, block_m, masked = case
    ids = _random_ids(tokens, k, experts, masked, seed=tokens * 131 + experts)
    check_alignment(ids, block_m, experts, moe_align_block_size(ids, block_m, experts))


@pytest.mark.parametrize("case", ALIGN_CASES)
def test_align_half_tiles_torch(case: tuple[int, int, int, int, float]) -> None:
    from sglang.kernels.ops.moe.align import moe_align_half_tiles

    tokens, k, experts, block_m, masked = case
    ids = _random_ids(tokens, k, experts, masked, seed=tokens * 7 + experts)
    check_half_tiles(ids, block_m, experts, moe_align_half_tiles(ids, block_m, experts))
    with pytest.raises(ValueError, match="even block_m"):
        moe_align_half_tiles(ids, 33, experts)


def test_align_half_tiles_count() -> None:
    """Experts of 12, 16, 17 and 0 rows at block_m 8 (half tiles of 4 rows): one whole tile and
    a half, two whole, two whole and a half (17 rows pad to 20), nothing."""
    from sglang.kernels.ops.moe.align import moe_align_half_tiles

    ids = torch.tensor([0] * 12 + [1] * 16 + [2] * 17, dtype=torch.int32).reshape(-1, 1)
    out = moe_align_half_tiles(ids, 8, 4)
    check_half_tiles(ids, 8, 4, out)
    n = int(out[4].item())
    assert out[3][:n].tolist() == [
        [0, 0, 0], [8, 0, 1], [12, 1, 0], [20, 1, 0], [28, 2, 0], [36, 2, 0], [44, 2, 1]
    ]  # fmt: skip


def test_align_one_hot_expert_and_ties() -> None:
    from sglang.kernels.ops.moe.align import moe_align_block_size

    ids = torch.zeros(37, 1, dtype=torch.int32)  # all on expert 0: 3 blocks of 16, 11 pads
    out = moe_align_block_size(ids, 16, 4)
    check_alignment(ids, 16, 4, out)
    assert int(out[2]) == 48
    assert torch.equal(out[0][:37], torch.arange(37, dtype=torch.int32)), "torch path is stable"


# --------------------------------------------------------------------------------------------
# FP8 quantisation
# --------------------------------------------------------------------------------------------

E4M3_REL = 2.0**-4  # half a unit in the last place of a 3-bit mantissa
E4M3_SUBNORMAL_ABS = 2.0**-10  # half the subnormal spacing (2^-9), in units of the scale


def _check_round_trip(x: torch.Tensor, deq: torch.Tensor, scale_full: torch.Tensor) -> None:
    bound = torch.maximum(x.abs() * E4M3_REL, scale_full * E4M3_SUBNORMAL_ABS) * (1 + 1e-5) + 1e-30
    err = (deq - x).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"


def test_per_token_group_quant_round_trip() -> None:
    from sglang.kernels.ops.quant.fp8 import FP8_MAX, per_token_group_quant_fp8

    g = torch.Generator().manual_seed(0)
    m, k, group = 6, 512, 128
    # Groups at very different magnitudes, one all-zero group (the eps guard) and one outlier.
    mags = torch.logspace(-4, 3, m * k // group).view(m, k // group, 1)
    x = (torch.randn(m, k // group, group, generator=g) * mags).view(m, k)
    x[2, :group] = 0.0
    x[4, 300] = 5e4
    q, s = per_token_group_quant_fp8(x, group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (m, k // group)
    amax = x.view(m, -1, group).abs().amax(-1)
    nz = amax > 0
    torch.testing.assert_close(s[nz], amax[nz] / FP8_MAX, rtol=1e-6, atol=0)
    assert (s[~nz] > 0).all() and (q.view(m, -1, group)[~nz].float() == 0).all()
    assert q.float().abs().max() <= FP8_MAX
    scale_full = s.repeat_interleave(group, dim=-1)
    _check_round_trip(x, q.float() * scale_full, scale_full)

    # Leading dims and a bf16 input.
    xb = x.view(2, 3, k).bfloat16()
    qb, sb = per_token_group_quant_fp8(xb, group)
    assert qb.shape == (2, 3, k) and sb.shape == (2, 3, k // group)
    with pytest.raises(ValueError):
        per_token_group_quant_fp8(torch.randn(2, 100), 128)


@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 200, 300), (130, 129)])
def test_block_weight_quant_round_trip(shape: tuple[int, ...]) -> None:
    from sglang.kernels.ops.quant.fp8 import FP8_MAX, block_dequant_fp8, block_quant_weight_fp8

    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g) * 0.02
    w[..., :5, :7] *= 300  # one tile with an outlier block
    q, s = block_quant_weight_fp8(w.bfloat16(), (128, 128))
    n, k = shape[-2:]
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == (*shape[:-2], math.ceil(n / 128), math.ceil(k / 128))
    wb = w.bfloat16().float()
    deq = block_dequant_fp8(q, s, (128, 128))
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    scale_full = s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]
    amax = wb.new_zeros(s.shape)
    for i in range(s.shape[-2]):
        for j in range(s.shape[-1]):
            amax[..., i, j] = (
                wb[..., i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().amax((-1, -2))
            )
    torch.testing.assert_close(s, amax / FP8_MAX, rtol=1e-6, atol=0)
    _check_round_trip(wb, deq, scale_full)
    assert block_dequant_fp8(q, s, (128, 128), dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        block_dequant_fp8(q, s[..., :1, :], (128, 128))


# --------------------------------------------------------------------------------------------
# Activations and the torch reference
# --------------------------------------------------------------------------------------------


def act64(gate_up: torch.Tensor, activation: str, limit: float | None) -> torch.Tensor:
    """The two activations from their definitions, in float64."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    if activation == "situ":
        return 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * 25.0 * torch.tanh(up / 25.0)
    if limit is not None:
        gate = torch.minimum(gate, torch.tensor(limit, dtype=torch.float64))
        up = up.clamp(-limit, limit)
    return gate / (1.0 + torch.exp(-gate)) * up


@pytest.mark.parametrize("activation,limit", ACTS)
def test_activation_reference(activation: str, limit: float | None) -> None:
    from sglang.kernels.ops.activation import act_and_mul_reference

    x = torch.randn(4, 3, 256) * 6
    got = act_and_mul_reference(x, activation, limit)
    assert got.shape == (4, 3, 128) and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), act64(x, activation, limit), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        act_and_mul_reference(x, "gelu", None)
    with pytest.raises(ValueError):
        act_and_mul_reference(x, "situ", 1.0)


def naive_moe64(moe: dict[str, Any], activation: str, limit: float | None) -> torch.Tensor:
    """Token by token, slot by slot, in float64 (FP8 weights dequantised, activations not)."""
    from sglang.kernels.ops.quant.fp8 import block_dequant_fp8

    x = moe["hidden"].double()
    w13, w2 = moe["w13"], moe["w2"]
    if "w13_scale" in moe:
        w13 = block_dequant_fp8(w13, moe["w13_scale"], (128, 128))
        w2 = block_dequant_fp8(w2, moe["w2_scale"], (128, 128))
    w13, w2 = w13.double(), w2.double()
    ids, wts = moe["topk_ids"], moe["topk_weights"]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if e < 0:
                continue
            h = act64(w13[e] @ x[t], activation, limit)
            out[t] += float(wts[t, s]) * (w2[e] @ h)
    return out


@pytest.mark.parametrize("activation,limit", ACTS)
@pytest.mark.parametrize(
    "dtype,fp8,tol",
    [(torch.float32, False, 1e-5), (torch.bfloat16, False, 1.5e-2), (torch.bfloat16, True, 6e-2)],
)
def test_reference_matches_naive_loop(
    activation: str, limit: float | None, dtype: torch.dtype, fp8: bool, tol: float
) -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts, fused_experts_torch

    moe = make_moe(tokens=9, experts=6, top_k=3, hidden=256, inter=128, dtype=dtype, fp8=fp8)
    want = naive_moe64(moe, activation, limit)
    got = fused_experts_torch(**moe, activation=activation, swiglu_limit=limit)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel_norm_err(got, want) < tol
    # On CPU the public entry point is the torch path.
    again = fused_experts(**moe, activation=activation, swiglu_limit=limit)
    assert torch.equal(again, got)


def test_reference_output_contract() -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts_torch

    moe = make_moe(
        tokens=5, experts=4, top_k=2, hidden=128, inter=128, dtype=torch.bfloat16, fp8=False
    )
    want = fused_experts_torch(**moe)
    hidden = moe["hidden"]
    assert want.data_ptr() != hidden.data_ptr()
    out = torch.full_like(want, float("nan"))
    got = fused_experts_torch(**moe, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)
    buf = hidden.clone()
    moe["hidden"] = buf
    got = fused_experts_torch(**moe, inplace=True)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf, want)
    # A fully masked token gets exactly zero.
    moe["hidden"] = hidden
    moe["topk_ids"] = moe["topk_ids"].clone()
    moe["topk_ids"][0] = -1
    assert (fused_experts_torch(**moe)[0] == 0).all()


def test_get_config_tiles() -> None:
    from sglang.kernels.ops.moe.fused_moe import get_config

    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for m in (1, 7, 64, 512, 2048, 8192):
            for e, k, h, i in ((256, 6, 4096, 2048), (384, 16, 3584, 3072)):
                cfg = get_config(m, e, h, i, dtype, top_k=k)
                assert cfg.block_m in (16, 32, 64, 128)
                for t in (cfg.gemm1, cfg.gemm2):
                    assert t.block_n >= 16 and t.block_k >= 16 and t.num_warps in (4, 8)
                    if dtype == torch.float8_e4m3fn:
                        assert 128 % t.block_k == 0, "FP8 K tiles must not straddle a scale block"
        assert get_config(1, 256, 4096, 2048, dtype, top_k=6).block_m == 16


# --------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (subprocess)
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the driver")
def test_triton_kernels_under_interpreter() -> None:
    # 99 s alone on a 2-core machine (every interp_ test of this file under the interpreter)
    run_interp_tests(str(Path(__file__).resolve()), timeout=hang_guard(100))


@interp_only
@pytest.mark.parametrize("activation,limit", ACTS)
def test_interp_activation_kernel(activation: str, limit: float | None) -> None:
    from sglang.kernels.ops.activation import act_and_mul_triton

    x = torch.randn(3, 5, 2 * 200) * 6
    x[0, 0, :8] = torch.tensor([0.0, 1e-4, -1e-4, 0.05, -0.05, 40.0, -40.0, 3.0])
    got = act_and_mul_triton(x, activation, limit)
    assert got.shape == (3, 5, 200) and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), act64(x, activation, limit), rtol=2e-6, atol=1e-7)
    xb = x.bfloat16()
    got_b = act_and_mul_triton(xb, activation, limit)
    assert got_b.dtype == torch.bfloat16
    torch.testing.assert_close(got_b.double(), act64(xb, activation, limit), rtol=1e-2, atol=1e-3)


@interp_only
def test_interp_group_quant_kernel() -> None:
    from sglang.kernels.ops.quant.fp8 import per_token_group_quant_fp8

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(7, 640, generator=gen) * torch.logspace(-3, 2, 7).unsqueeze(-1)
    x[3, 128:256] = 0.0
    q_t, s_t = per_token_group_quant_fp8(x, 128, use_triton=True)
    q_r, s_r = per_token_group_quant_fp8(x, 128, use_triton=False)
    torch.testing.assert_close(s_t, s_r, rtol=1e-6, atol=0)
    a, b = q_t.float(), q_r.float()
    slip = a != b
    # Interpreter-only fp8 cast flaws (the GPU test compares the compiled kernel exactly):
    # a round-up into the next binade lands on half of it, and e4m3 subnormals (|v| < 2^-6) may
    # be off by one subnormal step (2^-9).
    assert slip.float().mean() < 0.1
    normal = b.abs() >= 2.0**-6
    assert torch.equal(a[slip & normal] * 2, b[slip & normal]), "mismatches other than the slip"
    assert ((a - b)[slip & ~normal].abs() <= 2.0**-9).all(), "subnormal mismatch beyond one step"


@interp_only
@pytest.mark.parametrize("case", ALIGN_CASES)
def test_interp_align_kernel(case: tuple[int, int, int, int, float]) -> None:
    from sglang.kernels.ops.moe.align import moe_align_block_size, moe_align_block_size_torch

    tokens, k, experts, block_m, masked = case
    ids = _random_ids(tokens, k, experts, masked, seed=tokens * 17 + experts)
    got = moe_align_block_size(ids, block_m, experts)
    check_alignment(ids, block_m, experts, got)
    want = moe_align_block_size_torch(ids, block_m, experts)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


@interp_only
@pytest.mark.parametrize("case", [c for c in ALIGN_CASES if c[3] >= 2])
def test_interp_align_half_tiles_kernel(case: tuple[int, int, int, int, float]) -> None:
    from sglang.kernels.ops.moe.align import half_tile_table_torch, moe_align_half_tiles

    tokens, k, experts, block_m, masked = case
    ids = _random_ids(tokens, k, experts, masked, seed=tokens * 19 + experts)
    got = moe_align_half_tiles(ids, block_m, experts)
    check_half_tiles(ids, block_m, experts, got)
    table, num_tiles = half_tile_table_torch(got[1], block_m)
    assert torch.equal(got[3], table) and torch.equal(got[4], num_tiles)


@pytest.mark.parametrize("k,experts,block_m", [(6, 256, 16), (16, 384, 16), (3, 5, 32)])
def test_align_one_token_torch(k: int, experts: int, block_m: int) -> None:
    _check_one_token_align(k, experts, block_m)


def test_align_any_order_takes_the_one_token_blocks_at_one_token() -> None:
    """One token gets a block a slot in slot order; more tokens the expert-sorted blocks."""
    from sglang.kernels.ops.moe.align import (
        moe_align_any_order,
        moe_align_block_size,
        moe_align_one_token,
    )

    one = torch.tensor([[7, 2, 5]], dtype=torch.int32)  # slot order is not expert order
    got, want = moe_align_any_order(one, 16, 8), moe_align_one_token(one, 16, 8)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not torch.equal(got[1], moe_align_block_size(one, 16, 8)[1][:3])
    two = torch.tensor([[7, 2, 5], [1, 7, 0]], dtype=torch.int32)
    got, want = moe_align_any_order(two, 16, 8), moe_align_block_size(two, 16, 8)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@interp_only
@pytest.mark.parametrize("k,experts,block_m", [(6, 256, 16), (16, 384, 16), (3, 5, 32)])
def test_interp_align_one_token_kernel(k: int, experts: int, block_m: int) -> None:
    _check_one_token_align(k, experts, block_m)


def _check_one_token_align(k: int, experts: int, block_m: int) -> None:
    """A block per slot in slot order: the slot in the block's first row, padding after it, the
    slot's expert (-1 when masked or out of range), and every block counted."""
    from sglang.kernels.ops.moe.align import moe_align_one_token, padded_size

    g = torch.Generator().manual_seed(k * experts)
    ids = torch.randperm(experts, generator=g)[:k].to(torch.int32).reshape(1, k)
    ids[0, 1] = -1
    ids[0, -1] = experts + 3  # out of range counts as masked
    sorted_ids, expert_ids, ntpp = moe_align_one_token(ids, block_m, experts)
    assert sorted_ids.shape == (padded_size(k, block_m, experts),) == (k * block_m,)
    blocks = sorted_ids.view(k, block_m)
    assert torch.equal(blocks[:, 0], torch.arange(k, dtype=torch.int32))
    assert (blocks[:, 1:] == k).all(), "the rest of each block is the sentinel"
    want = ids[0].clone()
    want[1], want[-1] = -1, -1
    assert torch.equal(expert_ids, want) and int(ntpp.item()) == k * block_m
    with pytest.raises(ValueError, match=r"\[1, k\]"):
        moe_align_one_token(torch.zeros(2, k, dtype=torch.int32), block_m, experts)


def _tiny_configs() -> list[object]:
    from sglang.kernels.ops.moe.fused_moe import FusedMoeConfig, GemmTile

    return [
        None,  # get_config's own tiles
        FusedMoeConfig(16, GemmTile(16, 32, 2, 4, 2), GemmTile(32, 32, 2, 4, 2)),
        FusedMoeConfig(32, GemmTile(32, 64, 1, 4, 2), GemmTile(16, 16, 4, 4, 2)),
    ]


@interp_only
@pytest.mark.parametrize("activation,limit", ACTS)
@pytest.mark.parametrize("cfg_index", [0, 1, 2])
@pytest.mark.parametrize("shape", [(1, 4, 2, 64, 32), (9, 6, 3, 80, 48), (13, 5, 4, 48, 40)])
def test_interp_fused_experts_fp32(
    activation: str,
    limit: float | None,
    cfg_index: int,
    shape: tuple[int, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sglang.kernels.ops.moe.fused_moe as fm

    tokens, experts, k, hidden, inter = shape
    moe = make_moe(tokens, experts, k, hidden, inter, torch.float32, fp8=False, seed=cfg_index)
    cfg = _tiny_configs()[cfg_index]
    want = fm.fused_experts_torch(**moe, activation=activation, swiglu_limit=limit)
    out = torch.full_like(want, float("nan"))
    got = fm.fused_experts(**moe, activation=activation, swiglu_limit=limit, out=out, config=cfg)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    assert rel_norm_err(out, want) < 1e-5
    # In place, in chunks smaller than the batch.
    monkeypatch.setattr(fm, "CHUNK_TOKENS", 4)
    buf = moe["hidden"].clone()
    moe["hidden"] = buf
    got = fm.fused_experts(
        **moe, activation=activation, swiglu_limit=limit, inplace=True, config=cfg
    )
    assert got.data_ptr() == buf.data_ptr()
    assert rel_norm_err(buf, want) < 1e-5


@interp_only
@pytest.mark.parametrize("activation,limit", ACTS)
@pytest.mark.parametrize("cfg_index", [0, 1])
def test_interp_fused_experts_fp8(
    activation: str, limit: float | None, cfg_index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sglang.kernels.ops.moe.fused_moe as fm
    from sglang.kernels.ops.moe.fused_moe import FusedMoeConfig, GemmTile
    from sglang.kernels.ops.quant.fp8 import per_token_group_quant_fp8

    # The interpreter's fp8 cast slips (see the module docstring): quantise activations in torch.
    monkeypatch.setattr(
        fm,
        "per_token_group_quant_fp8",
        functools.partial(per_token_group_quant_fp8, use_triton=False),
    )
    cfg = [
        FusedMoeConfig(16, GemmTile(32, 128, 2, 4, 2), GemmTile(32, 128, 2, 4, 2)),
        FusedMoeConfig(16, GemmTile(32, 64, 2, 4, 2), GemmTile(64, 128, 2, 4, 2)),
    ][cfg_index]
    moe = make_moe(6, 4, 2, 256, 128, torch.float32, fp8=True, seed=3)
    want = fm.fused_experts_torch(**moe, activation=activation, swiglu_limit=limit)
    out = torch.full_like(want, float("nan"))
    got = fm.fused_experts(**moe, activation=activation, swiglu_limit=limit, out=out, config=cfg)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    # fp32 sums in another order can tip an intermediate across an fp8 rounding boundary.
    assert rel_norm_err(out, want) < 2e-3


_INPUT_KEYS = ("hidden", "w13", "w2", "topk_weights", "topk_ids", "w13_scale", "w2_scale")


def _tiny_tma_configs() -> list[object]:
    from sglang.kernels.ops.moe.grouped_gemm_tma import TmaGemmTile, TmaMoeConfig

    return [
        TmaMoeConfig(16, TmaGemmTile(16, 32, 2, 4, 2), TmaGemmTile(32, 16, 2, 4, 2)),
        TmaMoeConfig(
            32, TmaGemmTile(32, 16, 1, 4, 2, persistent=False), TmaGemmTile(16, 32, 4, 4, 2)
        ),
        TmaMoeConfig(16, TmaGemmTile(16, 32, 2, 4, 2, paired=True), TmaGemmTile(32, 16, 2, 4, 2)),
        TmaMoeConfig(16, TmaGemmTile(32, 16, 2, 4, 2), TmaGemmTile(16, 32, 2, 4, 2), sorted_a=True),
        # Half tiles: 32-row tiles, and 16-row ones closing an expert (gathered and sorted A).
        TmaMoeConfig(
            32, TmaGemmTile(16, 32, 2, 4, 2), TmaGemmTile(32, 16, 2, 4, 2), half_tiles=True
        ),
        TmaMoeConfig(
            32,
            TmaGemmTile(16, 32, 2, 4, 2, paired=True),
            TmaGemmTile(16, 32, 1, 4, 2),
            sorted_a=True,
            half_tiles=True,
        ),
    ]


@interp_only
@pytest.mark.parametrize("cfg_index", [0, 1, 2, 3, 4, 5])
def test_interp_tma_fused_experts_fp32(cfg_index: int) -> None:
    """The Hopper prefill kernels (tensor descriptors, persistent tile loop, sorted intermediate)
    on fp32 under the interpreter: 13 tokens, 5 experts (some empty), non-multiple row counts."""
    import sglang.kernels.ops.moe.fused_moe as fm

    activation, limit = ACTS[cfg_index % len(ACTS)]  # one a config keeps the subprocess short
    cfg = _tiny_tma_configs()[cfg_index]
    tokens = 120 if cfg.half_tiles else 13  # type: ignore[attr-defined]
    moe = make_moe(tokens, 5, 2, 64, 32, torch.float32, fp8=False, seed=40 + cfg_index)
    moe["topk_ids"][moe["topk_ids"] == 4] = 3  # expert 4 gets no rows
    if cfg.half_tiles:  # type: ignore[attr-defined]
        from sglang.kernels.ops.moe.align import moe_align_half_tiles

        _, _, _, table, n = moe_align_half_tiles(moe["topk_ids"], cfg.block_m, 5)  # type: ignore[attr-defined]
        kinds = set(table[: int(n), 2].tolist())
        assert kinds == {0, 1}, f"the case must run whole and half tiles, got {kinds}"
    want = fm.fused_experts_torch(**moe, activation=activation, swiglu_limit=limit)
    out = torch.full_like(want, float("nan"))
    fm.fused_experts(**moe, activation=activation, swiglu_limit=limit, out=out, config=cfg)
    assert torch.isfinite(out).all()
    assert rel_norm_err(out, want) < 1e-5


@interp_only
@pytest.mark.parametrize("down_block_n", [64, 128])
def test_interp_tma_fp8_rescaled_accumulator_equals_scaled_products(down_block_n: int) -> None:
    """FP8 prefill kernels with one accumulator rescaled between K blocks give what the scaled
    product per K block gives, with row scales over four decades, weight scales that change from
    one K block to the next, and an all-zero weight block whose scale is 0 (the guard). Tiles
    whose columns span two weight scale blocks are refused with the reason."""
    import sglang.kernels.ops.moe.fused_moe as fm
    from sglang.kernels.ops.moe.grouped_gemm_tma import TmaGemmTile, TmaMoeConfig

    moe = make_moe(9, 4, 2, 512, 256, torch.float32, fp8=True, seed=61 + down_block_n)
    moe["hidden"] = moe["hidden"] * torch.logspace(-2, 2, 9).unsqueeze(-1)
    moe["w13_scale"] = moe["w13_scale"] * torch.logspace(-1, 1, moe["w13_scale"].shape[-1])
    moe["w2_scale"] = moe["w2_scale"] * torch.logspace(1, -1, moe["w2_scale"].shape[-1])
    moe["w13_scale"][1, 0, 2] = 0.0  # expert 1's first gate rows, K block 2: weights all zero
    g1 = TmaGemmTile(128, 64, 2, 4, 2)
    g2 = TmaGemmTile(down_block_n, 128, 2, 4, 2)
    plain = TmaMoeConfig(16, g1, g2)
    rescaled = TmaMoeConfig(16, replace(g1, rescale=True), replace(g2, rescale=True))
    kw = dict(moe, activation="swiglu", swiglu_limit=None)
    refused = [
        (TmaMoeConfig(16, replace(g1, block_n=64), g2), "multiple of 128"),
        (TmaMoeConfig(16, replace(g1, rescale=True, paired=True), g2), "split tiles"),
        (TmaMoeConfig(16, g1, TmaGemmTile(256, 128, 2, 4, 2, rescale=True)), "divide the scale"),
    ]
    for cfg, reason in refused:
        with pytest.raises(ValueError, match=reason):
            fm.fused_experts(**kw, config=cfg)
    want = fm.fused_experts(**kw, config=plain)
    out = torch.full_like(want, float("nan"))
    fm.fused_experts(**kw, config=rescaled, out=out)
    assert torch.isfinite(out).all() and want.abs().sum() > 0
    # fp32 rounding of the rescales can tip an intermediate across an fp8 rounding boundary.
    assert rel_norm_err(out, want) < 5e-3
    # Activations gathered (and quantised) in sorted order first: the same tiles, the same bits.
    assert torch.equal(fm.fused_experts(**kw, config=replace(plain, sorted_a=True)), want)
    sorted_rescaled = fm.fused_experts(**kw, config=replace(rescaled, sorted_a=True))
    assert torch.equal(sorted_rescaled, out)
    # Half tiles (16-row tiles under a 32-row block here): the same products per row.
    halves = fm.fused_experts(**kw, config=replace(rescaled, block_m=32, half_tiles=True))
    assert rel_norm_err(halves, out) < 5e-3


@interp_only
@pytest.mark.parametrize("group", [None, 128])
def test_interp_sorted_rows_are_the_tokens_rows(group: int | None) -> None:
    """Row p of the sorted copy is its slot's token row (with FP8, that row as the activation
    quantiser gives it, bit for bit), zeros for padding slots; rows past the used length are
    not written."""
    from sglang.kernels.ops.moe.align import moe_align_block_size
    from sglang.kernels.ops.moe.sorted_rows import gather_sorted_rows
    from sglang.kernels.ops.quant.fp8 import DEFAULT_EPS, FP8_MAX, per_token_group_quant_fp8

    top_k, hidden = 3, 384  # three 128-groups: not a power of two
    x = torch.randn(11, hidden, generator=torch.Generator().manual_seed(7)) * 3
    ids = torch.randint(0, 5, (11, top_k), generator=torch.Generator().manual_seed(8))
    ids[2, 1] = -1
    ids = ids.to(torch.int32)
    align = moe_align_block_size(ids, 16, 5)
    rows, scales = gather_sorted_rows(x, align, top_k=top_k, num_slots=33, group=group)
    sorted_ids, ntpp = align[0], int(align[2].item())
    assert rows.shape == (sorted_ids.shape[0], hidden) and ntpp < rows.shape[0]
    want, want_s = per_token_group_quant_fp8(x, 128) if group else (x, None)
    for p in range(ntpp):
        slot = int(sorted_ids[p])
        if slot < 33 and int(ids.view(-1)[slot]) >= 0:
            assert torch.equal(rows[p].float(), want[slot // top_k].float()), p
            if group:
                assert torch.equal(scales[p], want_s[slot // top_k]), p
        else:
            assert (rows[p].float() == 0).all(), p
            if group:
                assert torch.allclose(scales[p], torch.full((3,), DEFAULT_EPS / FP8_MAX))


@pytest.mark.skipif(IN_INTERPRETER, reason="compiles for the GPU; the interpreter never does")
@pytest.mark.parametrize("gate_up", [True, False], ids=["gate_up", "down"])
def test_tma_kernels_compile_for_sm90(gate_up: bool) -> None:
    """The Hopper MoE kernels go through Triton's whole compiler for sm_90 on the CPU (the
    interpreter runs them as Python and lets through what the compiler refuses, e.g. a global
    that is not a ``tl.constexpr``): FP8 with the rescaled accumulator and sorted activations.
    With half tiles both tile bodies are built (twice the wgmmas); without them the half-height
    body must not be (it would cost registers and compile time for nothing)."""
    pytest.importorskip("triton.backends.nvidia")
    from sglang.test.sm90_compile import TmaKernelSpec, compile_tma_kernel

    whole = TmaKernelSpec(gate_up, True, 128, 128, 128, 8, 3, rescale=True, sorted_a=gate_up)
    wgmmas = []
    for half_tiles in (False, True):
        kernel = compile_tma_kernel(replace(whole, half_tiles=half_tiles))
        assert kernel.asm.get("cubin"), f"no cubin for sm_90 (half_tiles={half_tiles})"
        wgmmas.append(kernel.asm["ptx"].count("wgmma.mma_async"))
    assert wgmmas[0] > 0 and wgmmas[1] == 2 * wgmmas[0], wgmmas


if __name__ == "__main__":
    run_this_file(__file__)
