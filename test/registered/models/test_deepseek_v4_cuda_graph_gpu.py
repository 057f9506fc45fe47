"""DeepSeek V4 decode CUDA graphs on a GPU (skipped elsewhere): the built-in model's architecture
(window 32, ratios 0/4/128/4, indexer top-8) with random weights, bf16, triton MoE runner.

- Graph replay == the same static decode run eagerly at the same padded size, for batches of
  1, 3 and 6 requests (padded to 1, 4 and 8) over many decode steps from prompts of different
  lengths, so the steps cross the window and the ratio-4 and ratio-128 blocks. Same kernels, same
  shapes: the logits must be bit-identical.
- Graph replay against the eager reference decode (per-request caches): only the attention's
  summation order differs before bf16 rounding, so the bound is the one the bf16 GPU tests use
  for incremental decoding (mean relative error < 0.05) and greedy tokens agree >= 95%. A MoE
  router's top-k can flip at a near-tie between the two (measured: the fused compressor step
  equals the torch path to fp32 rounding, yet its bf16 entries flipped layer 1's router at a gap
  of 7.2e-4, that step was 0.50 and the flipped token kept the next 30 steps at 0.03-0.06), so
  the reference follows the static path's choice where they differ at a near-tie
  (``RouteFollower``; a larger gap fails), and a tenth of the steps may still miss the bound.
- Capture refuses nothing it needs: no host sync in the captured step (capture would raise).
- The pool is paged (blocks of 128 tokens): replays read blocks added between them, and a reused
  slot's reused blocks hide the former owner's rows.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.default_model.config import default_model_config
from sglang.srt.default_model.generate import random_weights
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models import deepseek_v4_moe
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.loading import load_weights
from sglang.test.ci_register import register_cuda_ci
from sglang.test.decode_drift import RouteFollower
from sglang.test.graph_replay_check import (
    check_replay_against_static_and_reference,
    check_reused_slot,
    fill_and_free_slot,
)
from sglang.test.run import run_this_file

register_cuda_ci(est_time=90, suite="h200-1gpu")

VOCAB = 512
SIZES = [1, 2, 4, 8]
# Prompt lengths: decoding 40 steps from them crosses 32 (window), 128 and 256 (ratio 128).
LENGTHS = (5, 100, 230, 20, 61, 7)
STEPS = 40


def _model(a2a_backend: str = "none") -> DeepseekV4ForCausalLM:
    raw = default_model_config(VOCAB, 0, 1)
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict(raw),
        LayerBuildSpec(
            dtype=torch.bfloat16, device="cuda", moe_runner="triton", a2a_backend=a2a_backend
        ),
    )
    load_weights(model, random_weights(raw, seed=7), LoadOptions(progress=False))
    model.eval()
    # Blocks of 128 tokens: decoding crosses block edges (100 -> 140, 230 -> 270), so the graphs
    # must read blocks the table gained between replays.
    model.enable_slot_pool(max_slots=3 * len(LENGTHS), capacity=512, block_tokens=128)
    return model


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).cuda()


@pytest.mark.parametrize("a2a_backend", ["none", "megamoe"])
def test_graph_replay_equals_eager_static_and_reference(
    a2a_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # megamoe on one GPU without DeepGEMM: every MoE layer runs our Triton MegaMoE kernel,
    # captured in the graph like the two-launch runner.
    import sglang.srt.layers.moe.mega_moe_triton_backend as backend

    mega_calls: list[int] = []
    real = backend.run_triton_mega_routed
    monkeypatch.setattr(
        backend, "run_triton_mega_routed", lambda *a, **k: mega_calls.append(1) or real(*a, **k)
    )
    model = _model(a2a_backend)
    graphs = CudaGraphRunner(model, SIZES, torch.device("cuda"))
    graphs.capture()
    assert sorted(graphs.graphs) == SIZES
    with RouteFollower(deepseek_v4_moe) as routes:
        for bs in (1, 3, 6):
            seqs = [_ids(n + STEPS, seed=100 * bs + i) for i, n in enumerate(LENGTHS[:bs])]
            check_replay_against_static_and_reference(model, graphs, seqs, LENGTHS, STEPS, routes)
    assert bool(mega_calls) == (a2a_backend == "megamoe"), (
        "megamoe must take the Triton MegaMoE kernel"
    )


def test_replay_after_slot_reuse_and_padding_rows() -> None:
    model = _model()
    graphs = CudaGraphRunner(model, [2, 4], torch.device("cuda"))  # bs 1 pads to 2
    graphs.capture()
    pool = model.slot_pool
    assert pool is not None
    # A long request fills a slot, is freed; its successor must see none of its rows.
    fill_and_free_slot(model, graphs, _ids(300, 1), 260)
    reused, fresh = model.new_pooled_cache(), model.new_request_cache()
    short = _ids(30, 2)
    model.prefill(short[:3], reused)
    model.prefill(short[:3], fresh)
    others = [s for s in range(pool.max_slots) if s != reused.slot]
    snapshot = [layer.window[others].clone() for layer in pool.layers]
    check_reused_slot(model, graphs, reused, fresh, short, 3)
    for layer, snap in zip(pool.layers, snapshot):
        assert torch.equal(layer.window[others], snap)
    model.free_pooled_cache(reused)
    assert pool.block_pool.num_free == pool.block_pool.num_blocks  # no block leaked


if __name__ == "__main__":
    run_this_file(__file__)
