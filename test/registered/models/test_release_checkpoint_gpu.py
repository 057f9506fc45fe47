"""Real-width release checkpoints on the GPU (run on the H200; skipped elsewhere).

The test kit draws and quantises two layers of DeepSeek V4-Flash widths (hidden 4096, experts of
2048, 64 heads of 512, indexer 64 x 128; 32 of the 256 experts) and of Kimi K3 widths (hidden
7168, latent 3584, experts of 3072, KDA 96 x 128, MLA 96 heads, a dense layer of 33792; 32 of the
896 experts) on the GPU and writes them in the published layouts; the file tensors have the
published shapes at those widths; the engine's loaders read them onto the GPU (bf16, triton MoE
runner) and a prefill gives finite logits. The weights' resident bytes (``memory_allocated``
around the load) are printed against the checkpoint bytes of the rank's share
(``layout.rank_total_bytes()``) and held to <= 1.05x of it, which needs the dense FP8 weights and
MXFP4 experts to stay resident as shipped: until both do, that check is an expected failure
(strict: it reports when it starts passing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.loading import load_model
from sglang.test.ci_register import register_cuda_ci
from sglang.test.release_checkpoint import deepseek_v4, kimi_k3
from sglang.test.release_checkpoint.emit import ReleaseCheckpoint
from sglang.test.run import run_this_file

register_cuda_ci(est_time=180, suite="h200-1gpu")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
VOCAB = 4096
DSV4 = deepseek_v4.flash_config(
    deepseek_v4.flash_ratios(2), n_routed_experts=32, vocab_size=VOCAB, max_position_embeddings=4096
)
K3 = {**kimi_k3.k3_config(2, num_experts=32, vocab_size=VOCAB), "max_position_embeddings": 4096}
E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu


@dataclass(frozen=True)
class Loaded:
    ckpt: ReleaseCheckpoint
    model: Any
    resident: int  # bytes allocated on the GPU by the load


def _write_and_load(
    path: Path, write: Callable[..., ReleaseCheckpoint], config: dict[str, Any], load: Any
) -> Loaded:
    started = time.perf_counter()
    ckpt = write(path, config, device="cuda", keep_values=False)
    elapsed = time.perf_counter() - started
    gb = ckpt.layout.total_bytes() / 1e9
    print(f"\n{path.name}: wrote {gb:.2f} GB in {elapsed:.1f}s ({gb / elapsed:.2f} GB/s)")
    print(ckpt.layout.format_table())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    spec = LayerBuildSpec(dtype=torch.bfloat16, device="cuda", moe_runner="triton")
    model = load(path, spec, LoadOptions(progress=False))
    torch.cuda.synchronize()
    return Loaded(ckpt, model, torch.cuda.memory_allocated() - before)


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    path = tmp_path_factory.mktemp("dsv4_flash_2l")
    return _write_and_load(path, deepseek_v4.write_random, DSV4, load_model)


@pytest.fixture(scope="module")
def k3(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    path = tmp_path_factory.mktemp("k3_2l")
    return _write_and_load(path, kimi_k3.write_random, K3, load_model)


def _shapes(ckpt: ReleaseCheckpoint) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {n: (e.shape, e.dtype) for n, e in ckpt.layout.entries.items()}


def _prefill_is_finite(model: Any, n: int) -> None:
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        logits = model(ids, torch.arange(n, device="cuda"))
    assert logits.shape == (n, VOCAB) and bool(torch.isfinite(logits).all())
    assert float(logits.float().std()) > 0


def test_dsv4_flash_width_layout_loads_and_runs(dsv4: Loaded) -> None:
    got = _shapes(dsv4.ckpt)
    # deepseek_v4.md §3, V4-Flash shapes; layer 0 ratio 4 (indexer), layer 1 ratio 128
    want = {
        "layers.0.attn.wq_a.weight": ((1024, 4096), E4M3),
        "layers.0.attn.wq_a.scale": ((8, 32), E8M0),
        "layers.0.attn.wkv.weight": ((512, 4096), E4M3),
        "layers.0.attn.wq_b.weight": ((32768, 1024), E4M3),
        "layers.0.attn.wq_b.scale": ((256, 8), E8M0),
        "layers.0.attn.wo_a.weight": ((8192, 4096), E4M3),
        "layers.0.attn.wo_b.weight": ((4096, 8192), E4M3),
        "layers.0.attn.compressor.wkv.weight": ((1024, 4096), torch.bfloat16),
        "layers.0.attn.compressor.ape": ((4, 1024), torch.float32),
        "layers.0.attn.indexer.wq_b.weight": ((8192, 1024), E4M3),
        "layers.0.attn.indexer.weights_proj.weight": ((64, 4096), torch.bfloat16),
        "layers.0.attn.indexer.compressor.wkv.weight": ((256, 4096), torch.bfloat16),
        "layers.0.attn.indexer.compressor.ape": ((4, 256), torch.float32),
        "layers.1.attn.compressor.wkv.weight": ((512, 4096), torch.bfloat16),
        "layers.1.attn.compressor.ape": ((128, 512), torch.float32),
        "layers.0.ffn.gate.tid2eid": ((VOCAB, 6), torch.int32),
        "layers.1.ffn.experts.31.w1.weight": ((2048, 2048), torch.int8),
        "layers.1.ffn.experts.31.w1.scale": ((2048, 128), E8M0),
        "layers.1.ffn.experts.31.w2.weight": ((4096, 1024), torch.int8),
        "layers.1.ffn.experts.31.w2.scale": ((4096, 64), E8M0),
        "layers.1.ffn.shared_experts.w2.weight": ((4096, 2048), E4M3),
        "mtp.0.e_proj.weight": ((4096, 4096), E4M3),
    }
    assert {n: got[n] for n in want} == want
    _prefill_is_finite(dsv4.model, 300)  # crosses the window and two ratio-128 blocks


def test_k3_width_layout_loads_and_runs(k3: Loaded) -> None:
    got = _shapes(k3.ckpt)
    p = "language_model.model.layers."
    # kimi_k3.md §4 shapes; layer 0 KDA + dense MLP, layer 1 MLA + MoE
    want = {
        f"{p}0.self_attn.q_proj.weight": ((12288, 7168), torch.bfloat16),
        f"{p}0.self_attn.A_log": ((128,), torch.float32),
        f"{p}0.self_attn.q_conv1d.weight": ((12288, 1, 4), torch.float32),
        f"{p}0.mlp.gate_proj.weight": ((33792, 7168), torch.bfloat16),
        f"{p}1.self_attn.q_b_proj.weight": ((96 * 192, 1536), torch.bfloat16),
        f"{p}1.self_attn.kv_a_proj_with_mqa.weight": ((576, 7168), torch.bfloat16),
        f"{p}1.self_attn.kv_b_proj.weight": ((96 * 256, 512), torch.bfloat16),
        f"{p}1.block_sparse_moe.gate.weight": ((32, 7168), torch.bfloat16),
        f"{p}1.block_sparse_moe.routed_expert_down_proj.weight": ((3584, 7168), torch.bfloat16),
        f"{p}1.block_sparse_moe.shared_experts.gate_proj.weight": ((6144, 7168), torch.bfloat16),
        f"{p}1.block_sparse_moe.experts.31.w1.weight_packed": ((3072, 1792), torch.uint8),
        f"{p}1.block_sparse_moe.experts.31.w1.weight_scale": ((3072, 112), torch.uint8),
        f"{p}1.block_sparse_moe.experts.31.w2.weight_packed": ((3584, 1536), torch.uint8),
        f"{p}1.block_sparse_moe.experts.31.w2.weight_scale": ((3584, 96), torch.uint8),
    }
    assert {n: got[n] for n in want} == want
    _prefill_is_finite(k3.model, 100)  # crosses a 64-token KDA chunk


@pytest.mark.parametrize("name", ["dsv4", "k3"])
def test_resident_bytes_within_5_percent_of_the_checkpoint_share(
    name: str, request: pytest.FixtureRequest
) -> None:
    loaded: Loaded = request.getfixturevalue(name)
    share = loaded.ckpt.layout.rank_total_bytes()
    ratio = loaded.resident / share
    print(f"{name}: resident {loaded.resident / 2**30:.2f} GiB, share {share / 2**30:.2f} GiB")
    print(f"{name}: resident / checkpoint share = {ratio:.3f}")
    assert ratio <= 1.05, ratio


if __name__ == "__main__":
    run_this_file(__file__)
