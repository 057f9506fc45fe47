"""The per-thread-scalar Sinkhorn (an experiment, not wired into mHC) and its tile baseline
against the torch reference: random comb logits (scale 3, so the softmax is far from uniform),
fp32 -> max abs error 1e-6 (entries lie in [0, 1]; only exp and division rounding differ), token
counts across a block edge, 8 steps (20 in the GPU bench). On the GPU directly; on CPU in
Triton's interpreter (a subprocess: the interpreter is chosen when the kernels are defined)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=8)

_CHECK = textwrap.dedent("""
    import torch
    from sglang.kernels.ops.layernorm.mhc import _sinkhorn
    from sglang.kernels.ops.layernorm.mhc_sinkhorn_scalar import sinkhorn_scalar, sinkhorn_tile
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for tokens in (1, 33):
        g = torch.Generator(device).manual_seed(tokens)
        c = torch.randn(tokens, 4, 4, generator=g, device=device) * 3
        ref = _sinkhorn(c.double(), 1e-6, 8)
        for fn in (sinkhorn_scalar, sinkhorn_tile):
            out = fn(c, 1e-6, 8)
            err = float((out.double() - ref).abs().max())
            assert torch.isfinite(out).all() and err < 1e-6, (fn.__name__, tokens, err)
    print("SINKHORN_OK")
    """)


def test_scalar_and_tile_sinkhorn_match_torch() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "SINKHORN_OK" in proc.stdout, proc.stdout + proc.stderr


if __name__ == "__main__":
    run_this_file(__file__)
