"""Kernels chosen by fit, on the GPU (skipped elsewhere).

- The device's limits as torch reports them are the ones the CPU tests feed the decisions
  (``sglang.kernels.fit.limits.H200``) when this is an H200.
- fp32 fused MoE at a prefill size (the rule's tiles need 262144 B of shared memory): the fitted
  tiles run and match the torch experts; the unfitted ones, launched on purpose, fail with
  Triton's OutOfResources, which the warm-up wrapper maps to the ``fused_moe`` family, turns off
  and survives (the second attempt runs the torch experts: the same numbers).
- An fp32 DeepSeek V4 engine (the built-in model) starts with the default 8192-token prefill
  warm-up and CUDA graphs, and serves greedy tokens; so does a float16 one.
"""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.fit.limits import H200, device_limits
from sglang.kernels.fit.switch import family_off_reason, reset_families
from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_max_err

register_cuda_ci(est_time=150, suite="h200-1gpu")

pytestmark = pytest.mark.gpu

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = ["Hello, my name is", "The capital of France is", "def main():"]


@pytest.fixture(autouse=True)
def _families_on() -> None:
    reset_families()
    yield
    reset_families()


def test_limits_are_read_from_the_device() -> None:
    limits = device_limits(torch.device("cuda"))
    assert limits is not None
    props = torch.cuda.get_device_properties(0)
    assert limits.sm_count == props.multi_processor_count
    assert limits.capability == (props.major, props.minor)
    assert limits.shared_optin_bytes >= 48 * 1024
    if "H200" in props.name:
        assert limits.shared_optin_bytes == H200.shared_optin_bytes
        assert limits.sm_count == H200.sm_count and limits.regs_per_sm == H200.regs_per_sm


def _moe_case(t: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, k = 16, 1024, 512, 6
    x = torch.randn(t, h, device="cuda", generator=g)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, device="cuda", generator=g) * i**-0.5
    scores = torch.rand(t, e, device="cuda", generator=g)
    w, ids = scores.topk(k, dim=-1)
    return x, w13, w2, (w / w.sum(-1, keepdim=True)).float(), ids.int()


def test_fp32_fused_moe_at_prefill_size_runs_fitted_tiles() -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts, fused_experts_torch

    x, w13, w2, w, ids = _moe_case(8192)
    got = fused_experts(x, w13, w2, w, ids, activation="swiglu", swiglu_limit=10.0)
    want = fused_experts_torch(x, w13, w2, w, ids, activation="swiglu", swiglu_limit=10.0)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    assert rel_max_err(got, want) < 1e-2  # fp32 dots run on TF32 tensor cores


def test_a_real_launch_failure_turns_the_family_off_and_falls_back() -> None:
    from triton.runtime.errors import OutOfResources

    from sglang.kernels.ops.moe.fused_moe import fused_experts, fused_experts_torch
    from sglang.kernels.ops.moe.two_launch_config import get_config
    from sglang.srt.model_executor.kernel_fallback import run_with_kernel_fallback

    x, w13, w2, w, ids = _moe_case(4096)
    rule = get_config(8192, 256, 4096, 2048, torch.float32, top_k=6)  # 262144 B: over the limit
    with pytest.raises(OutOfResources):
        fused_experts(x, w13, w2, w, ids, config=rule)
    got = run_with_kernel_fallback(
        lambda: fused_experts(x, w13, w2, w, ids, config=rule), "GPU test"
    )
    assert "shared memory" in str(family_off_reason("fused_moe"))
    want = fused_experts_torch(x, w13, w2, w, ids)
    assert rel_max_err(got, want) < 1e-6  # the torch experts ran


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_engine_starts_and_serves(dtype: str) -> None:
    from sglang import Engine

    with Engine(device="cuda", dtype=dtype, random_seed=0, log_level="warning") as e:
        a = [r["output_ids"] for r in e.generate(PROMPTS, GREEDY)]
        b = [r["output_ids"] for r in e.generate(PROMPTS, GREEDY)]
        info = e.get_server_info()["model_info"]
    assert a == b and all(len(ids) == GREEDY["max_new_tokens"] for ids in a)
    assert info["dtype"] == dtype
    assert info["cuda_graph"].startswith("on ("), info["cuda_graph"]


if __name__ == "__main__":
    run_this_file(__file__)
