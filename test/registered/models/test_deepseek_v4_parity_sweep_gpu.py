"""DeepSeek V4 greedy parity sweep on CUDA (skipped elsewhere): the CPU sweep's cases with our
model on the GPU (fp32) and transformers on the CPU, through the per-request caches, the slot
pool's static decode and its CUDA-graph replay (triton MoE runner, which graphs need; its prefill
goes in chunks of 4 tokens a prompt so the fp32 kernel keeps its smallest tiles, which fit shared
memory).

Triton's ``tl.dot`` rounds fp32 inputs to TF32 unless told otherwise; the module asks for IEEE
fp32 dots (``TRITON_F32_DEFAULT=ieee``, read when a kernel compiles) so the MoE kernels round like
the reference. Rounding still differs from the CPU (other GEMM kernels), so a greedy row may flip
only where the reference margin is below twice our error on that row, and every logit must be
within 1e-3 of the largest |logit|.
"""

from __future__ import annotations

import os

import pytest
import torch

from sglang.test.ci_register import register_cuda_ci
from sglang.test.dsv4_parity import ALL_MIXES, random_case, run_case
from sglang.test.run import run_this_file

register_cuda_ci(est_time=240, suite="h200-1gpu")
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

REL_TOL = 1e-3
SEEDS = range(len(ALL_MIXES) + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", ["eager", "pooled", "graph"])
@pytest.mark.parametrize("seed", SEEDS)
def test_cuda_greedy_matches_transformers(seed: int, path: str) -> None:
    case = random_case(
        seed,
        max_len=300,
        num_prompts=3,
        new_tokens=8,
        path=path,  # type: ignore[arg-type]
    )
    r = run_case(case, device="cuda", margin_tol=None)
    print(
        f"{case.label} lengths {case.prompt_lens}: max err {r.max_err:.1e}, near-ties "
        f"{r.near_ties}, tied top-k rows {r.tie_breaks}"
    )
    assert r.ok, f"{case.label} lengths {case.prompt_lens}: diverged at {r.first_divergence}"
    assert r.max_err <= REL_TOL * r.max_ref, (case.label, r.max_err, r.max_ref)


if __name__ == "__main__":
    run_this_file(__file__)
