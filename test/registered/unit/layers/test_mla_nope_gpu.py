"""Kimi K3's MLA prefill attention on a GPU (skipped elsewhere): flash attention over v padded to
the q/k width, causal from position 0 and bottom-right aligned on top of a cached prefix, against
the same layer in fp32 on the CPU (the math path). K3's head widths (nope 128, rope 64, v 128),
bf16 on the GPU: relative Frobenius error under 1e-2, NaN-free, every row checked."""

from __future__ import annotations

import copy

import pytest
import torch

from sglang.srt.layers.attention.mla_nope import MLANoPEAttention, MLANoPEConfig
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.test.ci_register import register_cuda_ci
from sglang.test.random_params import randomize_params_
from sglang.test.run import run_this_file

register_cuda_ci(est_time=10, suite="h200-1gpu")

pytestmark = pytest.mark.gpu

HIDDEN, HEADS, KV_LORA, NOPE, ROPE, V = 256, 4, 128, 128, 64, 128


@pytest.mark.parametrize(("prefix", "n"), [(0, 300), (0, 1000), (200, 77), (513, 600)])
@torch.no_grad()
def test_prefill_attention_matches_fp32_math(prefix: int, n: int) -> None:
    cfg = MLANoPEConfig(HIDDEN, HEADS, None, KV_LORA, NOPE, ROPE, V, 1e-6, output_gate=True)
    cpu = MLANoPEAttention(cfg, LayerBuildSpec(dtype=torch.float32))
    randomize_params_(cpu, torch.Generator().manual_seed(0), vector_scale=0.5)
    gpu = copy.deepcopy(cpu).to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(prefix + n)
    q = torch.randn(n, HEADS, NOPE + ROPE, generator=gen)
    kv = torch.randn(prefix + n, KV_LORA + ROPE, generator=gen)
    want = cpu._attend_expanded(q, kv, prefix)
    got = gpu._attend_expanded(q.cuda().bfloat16(), kv.cuda().bfloat16(), prefix)
    assert got.shape == (n, HEADS, V) and bool(torch.isfinite(got).all())
    diff = got.float().cpu() - want
    assert float(diff.norm() / want.norm()) < 1e-2
    per_row = diff.flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)
    assert float(per_row.max()) < 3e-2, float(per_row.max())


if __name__ == "__main__":
    run_this_file(__file__)
