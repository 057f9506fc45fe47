"""The FP8 KV cache on the GPU (run on the H200; skipped elsewhere), with the checks of
``sglang.test.fp8_kv_checks`` (tolerances there) at the real widths:

- the Triton encoder bit-identical to torch's e4m3 cast, the row write and load at DeepSeek V4's
  entry (512, rope 64: 584 bytes) and indexer key (128: 136 bytes) and Kimi K3's latent (512 +
  64: 648 bytes);
- the compressor prefill and decode kernels writing FP8 entries (ratio 4 at 512 and 128, ratio
  128 at 512) against their torch paths and the fp32 entries;
- sparse decode attention (64 heads of 512, window 128, bf16 ring), sparse prefill attention,
  the indexer scores (64 heads of 128) and the absorbed MLA decode (16 heads, 512 + 64) reading
  FP8 rows, against the torch maths on the same bits (summation order) and the unquantised rows;
- CUDA graphs: DeepSeek V4 (the built-in model's architecture) and Kimi K3 (tiny) in bf16 with
  FP8 caches, graph replay bit-identical to the same static decode run eagerly at the padded
  size over steps that cross the window, the ratio-4 / ratio-128 blocks and block edges, and
  close to the eager per-request decode (same FP8 rows up to rounding flips of the writers);
- the engine with CUDA graphs and FP8 caches (``auto`` on a bf16 DeepSeek V4 is FP8): the graph
  replay's greedy tokens equal the eager static decode's at the same padded sizes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat
from sglang.test import fp8_kv_checks as checks
from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file

register_cuda_ci(est_time=150, suite="h200-1gpu")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REAL_FORMATS = [Fp8RowFormat(512, 64), Fp8RowFormat(128), Fp8RowFormat(576, 64)]


def test_gpu_codec_at_real_widths() -> None:
    checks.check_triton_codec(REAL_FORMATS, "cuda")
    for fmt in REAL_FORMATS:
        checks.check_round_trip(fmt, "cuda", rows=256)


@pytest.mark.parametrize("ratio,dim,tail", [(4, 512, 64), (4, 128, 0)])
def test_gpu_compress_prefill_writes_fp8(ratio: int, dim: int, tail: int) -> None:
    checks.check_compress_prefill(ratio, dim, 64, tail, "cuda", chunks=(300, 7, 1, 64))


@pytest.mark.parametrize("ratio,dim,tail", [(4, 512, 64), (4, 128, 0), (128, 512, 64)])
def test_gpu_compress_decode_writes_fp8(ratio: int, dim: int, tail: int) -> None:
    checks.check_compress_decode(ratio, dim, 64, tail, "cuda", steps=8)


def test_gpu_readers_at_real_widths() -> None:
    checks.check_sparse_decode(64, 512, 64, 128, "cuda", torch.bfloat16)
    checks.check_sparse_prefill(64, 512, 64, "cuda")
    checks.check_indexer_scores(64, 128, "cuda")
    checks.check_absorbed_mla(16, 512, 64, "cuda")


# --- CUDA graphs ---------------------------------------------------------------------------------

STEPS = 40


def _replay_equals_static(model: Any, graphs: Any, lengths: tuple[int, ...], vocab: int) -> None:
    """Replay == the static decode eagerly at the padded size (bit for bit); both close to the
    eager per-request decode over the same FP8 layout (mean relative error of the logits)."""
    from sglang.test.decode_drift import mean_rel

    g = torch.Generator().manual_seed(len(lengths))
    seqs = [torch.randint(0, vocab, (n + STEPS,), generator=g).cuda() for n in lengths]
    replayed = [model.new_pooled_cache() for _ in seqs]
    static = [model.new_pooled_cache() for _ in seqs]
    reference = [model.new_request_cache() for _ in seqs]
    for seq, n, *caches in zip(seqs, lengths, replayed, static, reference):
        for cache in caches:
            model.prefill(seq[:n], cache)
    size = graphs.padded_size(len(seqs))
    errs = []
    for t in range(STEPS):
        ids = torch.stack([seq[n + t] for seq, n in zip(seqs, lengths)])
        got = model.decode_pooled(ids, replayed, step=graphs.replay).clone()
        want = model.decode_pooled(ids, static, pad_to=size)
        assert torch.equal(got, want), (t, float((got - want).abs().max()))
        errs.append(mean_rel(got, model.decode(ids, reference)))
    errs.sort()
    print(f"FP8 replay vs eager reference: median {errs[len(errs) // 2]:.4f}, worst {errs[-1]:.4f}")
    # The static and reference writers quantise the same fp32 entries up to summation order;
    # a rounding flip moves one value by an e4m3 step, so most steps stay at the bf16 bound.
    assert errs[len(errs) // 2] < 0.05, errs
    for cache in replayed + static:
        model.free_pooled_cache(cache)


def test_gpu_dsv4_graphs_with_fp8_caches() -> None:
    from sglang.srt.default_model.config import default_model_config
    from sglang.srt.default_model.generate import random_weights
    from sglang.srt.layers.build_spec import LayerBuildSpec
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang.srt.model_loader.load_options import LoadOptions
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
    from sglang.srt.models.loading import load_weights

    raw = default_model_config(512, 0, 1)
    spec = LayerBuildSpec(dtype=torch.bfloat16, device="cuda", moe_runner="triton",
                          kv_cache_dtype="fp8_e4m3")  # fmt: skip
    model = DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_dict(raw), spec)
    load_weights(model, random_weights(raw, seed=7), LoadOptions(progress=False))
    model.eval()
    pool = model.enable_slot_pool(max_slots=12, capacity=512, block_tokens=128)
    comp = pool.layers[1].compressor
    assert comp is not None and comp.entries.dtype == torch.uint8
    graphs = CudaGraphRunner(model, [1, 2, 4], torch.device("cuda"))
    graphs.capture()
    _replay_equals_static(model, graphs, (5, 100, 230), 512)


def test_gpu_k3_graphs_with_fp8_latents() -> None:
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang.test.kimi_k3_tiny import CONFIG_A, VOCAB, make_model

    model = make_model(
        {**CONFIG_A, "qk_rope_head_dim": 16}, seed=5, dtype=torch.bfloat16, device="cuda",
        moe_runner="triton", kv_cache_dtype="fp8_e4m3",
    )  # fmt: skip
    pool = model.enable_slot_pool(max_slots=12, capacity=256, block_tokens=16)
    assert pool.latent_encoding.row_bytes == 72  # 32 e4m3 + 16 bf16 (32 B) + 1 scale, padded
    graphs = CudaGraphRunner(model, [1, 2, 4], torch.device("cuda"))
    graphs.capture()
    _replay_equals_static(model, graphs, (5, 40, 61), VOCAB)


# --- the engine ----------------------------------------------------------------------------------


def test_gpu_engine_graphs_with_fp8_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang import Engine
    from sglang.test.engine_graph_check import (
        GRAPH_CHECK_ENGINE_ARGS,
        assert_same_tokens,
        serve_eager_static_then_graphs,
    )

    with Engine(device="cuda", random_seed=0, log_level="warning") as e:  # auto, bf16
        assert e.get_server_info()["model_info"]["kv_cache_dtype"] == "fp8_e4m3"
    common = {**GRAPH_CHECK_ENGINE_ARGS, "dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"}
    prompts = ["Hello, my name is", "x" * 40, "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18"]
    params = {"max_new_tokens": 136, "temperature": 0, "ignore_eos": True}

    def run(engine: Any) -> list[list[int]]:
        assert engine.get_server_info()["model_info"]["kv_cache_dtype"] == "fp8_e4m3"
        return [engine.generate(p, params)["output_ids"] for p in prompts]

    want, got, _, on = serve_eager_static_then_graphs(common, run, monkeypatch)
    assert on.startswith("on (decode batch sizes 1, 2, 4, 8;"), on
    assert_same_tokens(got, want)


if __name__ == "__main__":
    run_this_file(__file__)
