"""Kimi K3 decode CUDA graphs on a GPU (skipped elsewhere; passing on the H200 is why
``SGLANG_K3_STATIC_DECODE`` is on by default): the tiny CONFIG_A shape (AttnRes blocks of 3, KDA
and MLA layers, latent MoE) with its rope width at 16 so the absorbed MLA kernel takes the
latents, random weights, bf16, the triton MoE runner.

- The static KDA / MLA steps through the kernels equal their torch paths
  (``sglang.test.k3_static_kernel_checks``, also run under the interpreter on CPU).
- Capture refuses nothing it needs: no host sync in the captured step (capture would raise).
- Graph replay == the same static decode run eagerly at the same padded size, for batches of 1, 3
  and 6 requests (padded to 1, 4 and 8) over many steps from prompts of different lengths, the
  steps crossing block edges (blocks of 16): same kernels, same shapes, so bit-identical logits.
- Replay against the eager reference decode (per-request caches): only summation orders differ
  before bf16 rounding, so the bf16 incremental-decoding bound of the DeepSeek V4 graph test
  (mean relative error < 0.05 on most steps, the reference following the static path's routing
  at router near-ties) and greedy agreement >= 95% (``sglang.test.graph_replay_check``).
- A freed slot reused by a short request hides the former owner; padding rows touch no other
  slot; every block comes back.
"""

from __future__ import annotations

import torch

from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.models import kimi_k3_moe
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.test import k3_static_kernel_checks
from sglang.test.ci_register import register_cuda_ci
from sglang.test.decode_drift import RouteFollower
from sglang.test.graph_replay_check import (
    check_replay_against_static_and_reference,
    check_reused_slot,
    fill_and_free_slot,
)
from sglang.test.kimi_k3_tiny import CONFIG_A, VOCAB, make_model
from sglang.test.run import run_this_file

register_cuda_ci(est_time=60, suite="h200-1gpu")

CONFIG_GPU = {**CONFIG_A, "qk_rope_head_dim": 16}  # latent 32 + rope 16: the kernel's widths
SIZES = [1, 2, 4, 8]
LENGTHS = (5, 40, 23, 2, 61, 9)
STEPS = 30  # 40 -> 70 and 61 -> 91 cross several 16-token blocks


def _model() -> KimiK3ForCausalLM:
    model = make_model(CONFIG_GPU, seed=5, dtype=torch.bfloat16, device="cuda", moe_runner="triton")
    model.enable_slot_pool(max_slots=3 * len(LENGTHS), capacity=256, block_tokens=16)
    return model


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).cuda()


def test_k3_static_kernel_paths_on_the_gpu() -> None:
    k3_static_kernel_checks.run_all("cuda")


def test_k3_graph_replay_equals_eager_static_and_reference() -> None:
    model = _model()
    graphs = CudaGraphRunner(model, SIZES, torch.device("cuda"))
    graphs.capture()
    assert sorted(graphs.graphs) == SIZES
    with RouteFollower(kimi_k3_moe) as routes:
        for bs in (1, 3, 6):
            seqs = [_ids(n + STEPS, seed=100 * bs + i) for i, n in enumerate(LENGTHS[:bs])]
            check_replay_against_static_and_reference(model, graphs, seqs, LENGTHS, STEPS, routes)


def test_k3_replay_after_slot_reuse_and_padding_rows() -> None:
    model = _model()
    graphs = CudaGraphRunner(model, [2, 4], torch.device("cuda"))  # bs 1 pads to 2
    graphs.capture()
    pool = model.slot_pool
    assert pool is not None
    fill_and_free_slot(model, graphs, _ids(120, 1), 80)
    reused, fresh = model.new_pooled_cache(), model.new_request_cache()
    assert reused.slot == 0
    bystander = model.new_pooled_cache()  # a running request outside the replayed batch
    model.prefill(_ids(7, 3), bystander)
    short = _ids(30, 2)
    model.prefill(short[:3], reused)
    model.prefill(short[:3], fresh)
    snapshot = [
        t[bystander.slot].clone() for k in pool.kda if k is not None for t in (k.conv, k.recurrent)
    ]
    check_reused_slot(model, graphs, reused, fresh, short, 3)
    now = [t[bystander.slot] for k in pool.kda if k is not None for t in (k.conv, k.recurrent)]
    assert all(torch.equal(a, b) for a, b in zip(snapshot, now))
    for cache in (reused, bystander):
        model.free_pooled_cache(cache)
    assert pool.block_pool.num_free == pool.block_pool.num_blocks  # no block leaked


if __name__ == "__main__":
    run_this_file(__file__)
