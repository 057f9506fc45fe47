"""MXFP4 -> FP8 128x128: the exactness condition (derived in ``mxfp4_to_fp8.py``) against brute
force over e4m3, random in-range blocks dequantising bit-equal, out-of-range blocks counted with
their error inside the bound, and the stats the load log prints."""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.quant.fp8 import block_dequant_fp8
from sglang.srt.layers.quantization.mxfp4 import dequant_mxfp4
from sglang.srt.layers.quantization.mxfp4_to_fp8 import (
    EXACT_SCALE_SPAN,
    EXACT_SPAN,
    MAX_ERROR_TO_AMAX,
    block_exponent_bounds,
    mxfp4_to_fp8_blocks,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=6)

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e4m3_exact(x: float) -> bool:
    t = torch.tensor([x], dtype=torch.float64)
    return float(t.to(torch.float8_e4m3fn).double()) == x


def test_the_binade_window_is_what_e4m3_holds() -> None:
    """Every E2M1 magnitude times 2^d is exact in e4m3 for d in [-8, 6] and some is not just
    outside: 17 binades between the lowest set bit (2^-9 subnormal) and the top (1.5 * 2^8)."""
    nonzero = [m for m in E2M1 if m]
    for d in range(-8, 7):
        assert all(_e4m3_exact(m * 2.0**d) for m in nonzero), d
    assert not _e4m3_exact(6.0 * 2.0**7)  # 768 > 448
    assert not _e4m3_exact(0.5 * 2.0**-9)  # below the smallest subnormal
    assert not _e4m3_exact(1.5 * 2.0**-9)  # 3 * 2^-10: not a multiple of 2^-9
    # the value-level rule at its edges: top 2 (6 = 1.5 * 2^2) and low -1 (0.5) span 3 binades
    assert EXACT_SPAN == 17 and EXACT_SCALE_SPAN == EXACT_SPAN - 3


def _random_mxfp4(
    e: int, n: int, k: int, gen: torch.Generator, span: int = 4, base: int = 120
) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(base, base + span + 1, (e, n, k // 32), dtype=torch.uint8, generator=gen)
    return packed, scales


@pytest.mark.parametrize("span", [0, 6, EXACT_SCALE_SPAN])
def test_blocks_within_the_scale_span_convert_bit_exactly(span: int) -> None:
    gen = torch.Generator().manual_seed(span)
    packed, scales = _random_mxfp4(3, 256, 384, gen, span=span)
    q, s, stats = mxfp4_to_fp8_blocks(packed, scales, experts_per_chunk=2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 256, 384)
    assert s.shape == (3, 2, 3) and s.dtype == torch.float32
    mantissa, _ = torch.frexp(s)
    assert bool((mantissa == 0.5).all())  # powers of two: UE8M0-valid
    want = dequant_mxfp4(packed, scales, torch.float32)
    assert torch.equal(block_dequant_fp8(q, s), want)
    assert stats.blocks == 18 and stats.inexact_blocks == 0 and stats.max_error_to_amax == 0.0


def _block_with(top: tuple[int, int], low: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One 128x128 block of small codes (1.0, scale 127) plus one value of magnitude code/scale
    ``top`` and one of ``low`` (code index, UE8M0 byte)."""
    codes = torch.full((128, 128), 2, dtype=torch.uint8)  # 1.0
    scales = torch.full((128, 4), 127, dtype=torch.uint8)
    codes[0, 0], scales[0, 0] = top[0], top[1]
    codes[64, 64], scales[64, 2] = low[0], low[1]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.unsqueeze(0), scales.unsqueeze(0)


@pytest.mark.parametrize(("extra", "exact"), [(0, True), (1, False)])
def test_the_value_level_edge_of_exactness(extra: int, exact: bool) -> None:
    # 6 * 2^(s-127) has top = s - 127 + 2; 0.5 * 2^(s'-127) has low = s' - 127 - 1.
    # top - low = 17 + extra: exact at 17, rounded at 18.
    s_top, s_low = 127 + 7, 127 - 7 - extra
    packed, scales = _block_with((7, s_top), (1, s_low))
    hi, lo = block_exponent_bounds(packed, scales)
    assert int(hi - lo) == EXACT_SPAN + extra
    q, s, stats = mxfp4_to_fp8_blocks(packed, scales)
    want = dequant_mxfp4(packed, scales, torch.float32)
    got = block_dequant_fp8(q, s)
    assert stats.inexact_blocks == (0 if exact else 1)
    assert torch.equal(got, want) == exact
    if not exact:
        err = float((got - want).abs().max())
        amax = float(want.abs().max())
        assert 0 < err <= MAX_ERROR_TO_AMAX * amax
        assert stats.max_error_to_amax == pytest.approx(err / amax, rel=1e-6)
        # the largest values stay exact: only the bottom of the block rounds
        assert float(got[0, 0, 0]) == float(want[0, 0, 0])


def test_wide_blocks_are_counted_and_bounded_among_exact_ones() -> None:
    gen = torch.Generator().manual_seed(7)
    packed, scales = _random_mxfp4(2, 256, 256, gen, span=3)
    scales[0, :128, :4] = 127 + 10  # block (0, 0, 0): top group far above
    scales[0, 5, 0] = 127 - 20  # ... and one group far below it
    q, s, stats = mxfp4_to_fp8_blocks(packed, scales)
    want = dequant_mxfp4(packed, scales, torch.float32)
    got = block_dequant_fp8(q, s)
    assert stats.blocks == 8 and stats.inexact_blocks == 1
    assert torch.equal(got[:, 128:], want[:, 128:]) and torch.equal(got[1], want[1])
    bad = (got[0, :128, :128] - want[0, :128, :128]).abs().max()
    assert 0 < float(bad) <= MAX_ERROR_TO_AMAX * float(want[0, :128, :128].abs().max())


def test_zero_blocks_and_the_byte_count() -> None:
    packed = torch.zeros(1, 128, 64, dtype=torch.uint8)
    scales = torch.full((1, 128, 4), 3, dtype=torch.uint8)
    q, s, stats = mxfp4_to_fp8_blocks(packed, scales)
    assert bool((q.float() == 0).all()) and float(s[0, 0, 0]) == 1.0 and stats.inexact_blocks == 0
    gen = torch.Generator().manual_seed(2)
    packed, scales = _random_mxfp4(2, 512, 1024, gen)
    *_, stats = mxfp4_to_fp8_blocks(packed, scales)
    assert stats.mxfp4_bytes == packed.numel() + scales.numel()
    assert stats.fp8_bytes == 2 * 512 * 1024 + 4 * 2 * 4 * 8
    assert 1.85 < stats.fp8_bytes / stats.mxfp4_bytes < 1.95  # FP8 is ~2x MXFP4 (scales aside)


def test_bad_inputs_name_the_problem() -> None:
    gen = torch.Generator().manual_seed(0)
    packed, scales = _random_mxfp4(1, 128, 128, gen)
    with pytest.raises(ValueError, match="in multiples of 128"):
        mxfp4_to_fp8_blocks(packed[:, :64], scales[:, :64])
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_to_fp8_blocks(packed, scales[..., :2])
    with pytest.raises(TypeError, match="uint8 UE8M0 scales"):
        mxfp4_to_fp8_blocks(packed, scales.float())


if __name__ == "__main__":
    run_this_file(__file__)
