"""The chunked KDA prefill kernels under Triton's interpreter on CPU tensors, against a float64
recurrence and through the layer (``sglang.test.kda_prefill_checks`` says what is checked and to
what bound). The interpreter must be on before triton is imported, so the checks run in a
subprocess. ``test_kda_chunk_prefill_gpu.py`` runs the same checks on a GPU, plus K3's width."""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import run_under_interpreter
from sglang.test.run import run_this_file

register_cpu_ci(est_time=40)


def test_kernels_under_interpreter() -> None:
    script = "from sglang.test import kda_prefill_checks as c; c.run_all('cpu'); print('KDA_OK')"
    run_under_interpreter(marker="KDA_OK", code=script, timeout=300)


# Hopper's shared memory per block (227 KB): the sequential pass once asked for 361 KB when its
# loop was software-pipelined three deep.
SM90_SHARED_LIMIT = 232448


@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
def test_kernels_compile_for_sm90(precision: str) -> None:
    """Triton's whole compiler for sm_90 on the CPU, at K3's head width and the launcher's
    defaults: every kernel compiles and fits in shared memory."""
    pytest.importorskip("triton")
    from sglang.kernels.ops.kda import chunk_prefill as cp
    from sglang.kernels.ops.kda import conv_prefill as conv
    from sglang.test.sm90_compile import compile_sm90

    base = {"H": 12, "K": 128, "CHUNK": cp.CHUNK, "PRECISION": precision}
    kernels = [
        (cp._chunk_cumsum_kernel, {"K": 128, "CHUNK": cp.CHUNK}, 4, 1),
        (cp._chunk_intra_kernel, base | {"SUB": cp.SUB, "MAX_EXP": cp.MAX_FACTOR_EXP}, 4, 1),
        (cp._chunk_solve_kernel, base | {"V": 128, "SUB": cp.SUB}, 4, 1),
        (cp._chunk_recurrence_kernel, base | {"V": 128, "BV": cp.default_block_v(128, 12)}, 4, 1),
    ]
    conv_const = {"W": 4, "BLOCK_T": conv.BLOCK_T, "BLOCK_C": conv.BLOCK_C}
    kernels.append((conv._conv_prefill_kernel, conv_const, 4, 3))
    for fn, const, warps, stages in kernels:
        sig = {n: "*fp32" if n.endswith("_ptr") else "i32" for n in fn.arg_names if n not in const}
        kernel = compile_sm90(fn, sig, const, warps, stages)
        assert kernel.metadata.shared <= SM90_SHARED_LIMIT, (fn.__name__, kernel.metadata.shared)


if __name__ == "__main__":
    run_this_file(__file__)
