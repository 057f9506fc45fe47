"""Kimi K3's static decode steps through the Triton kernels (KDA states addressed by slot, the
absorbed MLA kernel over whole table rows with device lengths) against their torch paths, under
Triton's interpreter on CPU tensors (``sglang.test.k3_static_kernel_checks`` says what is checked
and to what bound). The interpreter must be on before triton is imported, so the checks run in a
subprocess; the GPU graph test runs the same checks on the GPU."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import run_under_interpreter
from sglang.test.run import run_this_file

register_cpu_ci(est_time=10)


def test_static_kernels_under_interpreter() -> None:
    script = (
        "from sglang.test import k3_static_kernel_checks as c; c.run_all('cpu'); print('K3_OK')"
    )
    run_under_interpreter(marker="K3_OK", code=script)


if __name__ == "__main__":
    run_this_file(__file__)
