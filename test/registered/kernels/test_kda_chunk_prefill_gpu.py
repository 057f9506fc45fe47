"""The chunked KDA prefill kernels on a GPU (skipped elsewhere): the checks of
``sglang.test.kda_prefill_checks`` on CUDA tensors in every dot precision, plus K3's head width
(128) at lengths that span many chunks, against the float64 recurrence."""

from __future__ import annotations

import pytest

from sglang.test import kda_prefill_checks as checks
from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file

register_cuda_ci(est_time=60, suite="h200-1gpu")

pytestmark = pytest.mark.gpu

# K3's heads (128 wide) at lengths across many chunks, the strong gate included
K3_CASES = [
    (1000, 4, 128, 128, "mixed", 64),
    (777, 3, 128, 128, "strong", 32),
    (1500, 2, 128, 128, "weak", 128),
    (300, 2, 64, 128, "mixed", 16),
]


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "tf32"])
def test_against_float64(precision: str) -> None:
    checks.check_against_float64("cuda", checks.CPU_CASES + K3_CASES, precision)


def test_conv_prefill() -> None:
    checks.check_conv_prefill("cuda")


def test_layer_prefill() -> None:
    checks.check_layer_prefill("cuda")


def test_reasons_and_errors() -> None:
    checks.check_reasons_and_errors("cuda")


if __name__ == "__main__":
    run_this_file(__file__)
