"""The FP8 KV rows (``kernels/ops/quant/fp8_rows.py``) and every kernel that writes or reads them,
on the CPU: the format in torch, the kernels under the Triton interpreter (in a subprocess: the
interpreter is chosen when Triton loads), small widths. The checks and their tolerances are
``sglang.test.fp8_kv_checks``'s (shared with the GPU test at the real widths):

- quantise / dequantise round trip on fresh random rows within e4m3 precision (2^-4 relative,
  2^-10 of the scale below the normal range), the bf16 tail exact, every value a bf16 value;
- the Triton encoder bit-identical to torch's e4m3 cast (every code, every tie, subnormals), the
  row write kernel's bytes equal to the torch quantiser's, the kernels' row load equal to the
  torch dequantiser;
- the compressor prefill and decode kernels writing FP8 entries (ratio 4 with a bf16 rope tail,
  the indexer's keys without, ratio 128) against their torch paths: the same bytes but for rare
  rounding flips (values one e4m3 step apart there), and within half a step of the fp32 entries;
- sparse decode and prefill attention, the indexer scores and the absorbed MLA decode reading
  FP8 rows, against the torch maths on the same bits decoded (summation order: 1e-5 / 2e-5) and
  against the unquantised rows (quantisation: 8% relative Frobenius).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang.kernels.ops.quant.fp8_rows import K_MIN, Fp8RowFormat, group_exponent_torch
from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import IN_INTERPRETER, interp_only, run_interp_tests
from sglang.test.run import run_this_file

register_cpu_ci(est_time=40)


# DeepSeek V4's entry and indexer key, Kimi K3's latent, and tiny widths (groups < 64).
REAL_FORMATS = [Fp8RowFormat(512, 64), Fp8RowFormat(128), Fp8RowFormat(576, 64)]
TINY_FORMATS = [Fp8RowFormat(64, 16), Fp8RowFormat(32), Fp8RowFormat(40, 8)]


def test_layouts_and_their_sizes() -> None:
    entry, key, latent = REAL_FORMATS
    assert (entry.row_bytes, key.row_bytes, latent.row_bytes) == (584, 136, 648)
    assert (entry.group, entry.num_scales, entry.rope_offset, entry.scale_offset) == (
        64,
        7,
        448,
        576,
    )
    assert Fp8RowFormat(64, 16).group == 16 and Fp8RowFormat(56, 8).num_scales == 3
    assert entry.describe() == "448 e4m3 + 64 bf16 + 7 UE8M0 scales (one per 64) = 584 B"
    with pytest.raises(ValueError, match="rope < dim"):
        Fp8RowFormat(64, 64)
    with pytest.raises(ValueError, match="last dim"):
        entry.quantize(torch.zeros(2, 448))
    with pytest.raises(ValueError, match="uint8"):
        entry.dequantize(torch.zeros(2, 584))


def test_group_exponents() -> None:
    """The least ``k`` with ``amax <= 448 * 2^k``, read off the bits (1.75 * 2^8 = 448)."""
    amax = torch.tensor([448.0, 448.00004, 224.0, 224.00002, 1.0, 0.0, 1e-38, 3e38])
    assert group_exponent_torch(amax).tolist() == [0, 1, -1, 0, -8, K_MIN, K_MIN, 119]


@pytest.mark.parametrize("fmt", REAL_FORMATS + TINY_FORMATS, ids=str)
def test_round_trip_within_e4m3_precision(fmt: Fp8RowFormat) -> None:
    from sglang.test.fp8_kv_checks import check_round_trip

    check_round_trip(fmt, "cpu", seed=fmt.dim)


@interp_only
def test_interp_codec_matches_torch() -> None:
    from sglang.test.fp8_kv_checks import check_triton_codec

    check_triton_codec(TINY_FORMATS, "cpu")


@interp_only
@pytest.mark.parametrize("ratio,dim,rope,tail", [(4, 64, 16, 16), (4, 32, 16, 0), (8, 64, 16, 16)])
def test_interp_compress_prefill_writes_fp8(ratio: int, dim: int, rope: int, tail: int) -> None:
    from sglang.test.fp8_kv_checks import check_compress_prefill

    check_compress_prefill(ratio, dim, rope, tail, "cpu")


@interp_only
@pytest.mark.parametrize("ratio,dim,tail,steps", [(4, 64, 16, 6), (4, 32, 0, 5), (128, 64, 16, 3)])
def test_interp_compress_decode_writes_fp8(ratio: int, dim: int, tail: int, steps: int) -> None:
    from sglang.test.fp8_kv_checks import check_compress_decode

    check_compress_decode(ratio, dim, 16, tail, "cpu", steps=steps)


@interp_only
def test_interp_readers_dequantise_exactly() -> None:
    from sglang.test import fp8_kv_checks as c

    c.check_sparse_decode(4, 64, 16, 16, "cpu", torch.float32)  # fp32 ring: the interpreter's
    c.check_sparse_prefill(4, 64, 16, "cpu")  # bf16 dot is wrong, fp32 holds the values
    c.check_indexer_scores(4, 32, "cpu")
    c.check_absorbed_mla(2, 32, 16, "cpu")


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the driver")
def test_kernels_under_interpreter() -> None:
    run_interp_tests(str(Path(__file__).resolve()), timeout=600)


if __name__ == "__main__":
    run_this_file(__file__)
