"""The chunked KDA prefill kernels under Triton's interpreter on CPU tensors, against a float64
recurrence and through the layer (``sglang.test.kda_prefill_checks`` says what is checked and to
what bound). The interpreter must be on before triton is imported, so the checks run in a
subprocess. ``test_kda_chunk_prefill_gpu.py`` runs the same checks on a GPU, plus K3's width."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import run_under_interpreter
from sglang.test.run import run_this_file

register_cpu_ci(est_time=40)


def test_kernels_under_interpreter() -> None:
    script = "from sglang.test import kda_prefill_checks as c; c.run_all('cpu'); print('KDA_OK')"
    run_under_interpreter(marker="KDA_OK", code=script, timeout=300)


if __name__ == "__main__":
    run_this_file(__file__)
