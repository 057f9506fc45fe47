"""The KDA decode kernels (conv, recurrent step) under Triton's interpreter on CPU tensors, against
their torch forms and through the layer (``sglang.test.kda_decode_checks`` says what is checked and
to what bound). The interpreter must be on before triton is imported, so the checks run in a
subprocess. ``test_kda_decode_kernels_gpu.py`` runs the same checks on a GPU."""

from __future__ import annotations

from sglang.kernels.ops.pointer_table import pointer_table_reason
from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import run_under_interpreter
from sglang.test.run import run_this_file

register_cpu_ci(est_time=15)


def test_kernels_under_interpreter() -> None:
    script = "from sglang.test import kda_decode_checks as c; c.run_all('cpu'); print('KDA_OK')"
    run_under_interpreter(marker="KDA_OK", code=script, timeout=180)


def test_pointer_table_reason() -> None:
    import torch

    a, b = torch.randn(4, 8), torch.randn(4, 8)
    cpu, meta = torch.device("cpu"), torch.device("meta")

    def why(tensors: list[torch.Tensor], device: torch.device = cpu) -> str:
        return str(pointer_table_reason(tensors, (4, 8), torch.float32, device, "state"))

    assert pointer_table_reason([a, b], (4, 8), torch.float32, cpu, "state") is None
    assert "share" in why([a, a])
    assert "(4, 8)" in why([a, b[:, :4]])
    assert "torch.float32" in why([a, b.double()])
    assert "the kernel runs on meta" in why([a], meta)
    assert "aligned" in why([torch.randn(40)[1:33].view(4, 8)])


if __name__ == "__main__":
    run_this_file(__file__)
