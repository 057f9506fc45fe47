"""The length-aware DeepSeek V4 decode kernels on a GPU (skipped elsewhere) against the torch
static path they replace, on random bf16 pools and many lengths.

- ``sparse_decode_attention`` (window only, ratio-128 style all visible entries, indexed picks)
  against ``sink_attention`` over the gathered rows under the position masks, at positions before,
  across and far past the window and the block boundaries, with padded heads (8) and the bench
  width (64 heads of 512): fp32 maths both sides, bf16 products exact, the probabilities split
  into two bf16 parts -> relative error ~1e-6; bound 1e-4. Outputs are checked finite (the
  kernel writes into an empty tensor).
- ``indexer_scores`` against the torch scoring: the same ``-inf`` pattern (only visible entries
  scored), values to 1e-4 of the largest.
- The compressor's bf16 GEMM with fp32 output against the upcast product (1e-5).
- The model's static decode with the kernels against the same decode with the torch path
  (separate slots, same prompts, one step): logits to a mean relative error 1e-2 (bf16 layers
  after the attention), greedy tokens equal on all rows but at most one (a near-tie).
"""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.attention.indexer_scores import indexer_scores
from sglang.kernels.ops.attention.sparse_decode_attention import sparse_decode_attention
from sglang.srt.layers.attention import dsv4_static_decode
from sglang.srt.layers.attention.dsv4_static_decode import sink_attention
from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file

register_cuda_ci(est_time=60)

pytestmark = pytest.mark.gpu
TOL = 1e-4


def _pool(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


@pytest.mark.parametrize("heads,dim", [(8, 64), (64, 512)])
@pytest.mark.parametrize("mode", ["window", "dense", "indexed"])
def test_attention_matches_torch(heads: int, dim: int, mode: str) -> None:
    g = torch.Generator("cuda").manual_seed(heads + dim + len(mode))
    window, ratio, cap, topk = 128, 4 if mode == "indexed" else 128, 4096, 64
    n_ent = cap // ratio + 1
    slots_total = 12
    ring = _pool((slots_total, window, dim), g)
    entries = _pool((slots_total, n_ent, dim), g)
    positions = torch.tensor([0, 1, 3, 126, 127, 128, 129, 300, 511, 1000, 2047, 4095])
    bs = positions.numel()
    positions = positions.cuda()
    slots = torch.randperm(slots_total, generator=g, device="cuda")
    q = _pool((bs, heads, dim), g)
    sink = torch.randn(heads, generator=g, device="cuda")
    scale = dim**-0.5
    rows = torch.arange(window, device="cuda")
    win_pos = positions[:, None] - (positions[:, None] - rows[None, :]) % window
    keys, valid = [ring[slots]], [win_pos >= 0]
    visible = (positions + 1) // ratio
    ids = torch.arange(n_ent, device="cuda")
    kwargs: dict[str, object] = {}
    if mode == "dense":
        keys.append(entries[slots])
        valid.append(ids[None, :] < visible[:, None])
        kwargs = {"entries": entries, "ratio": ratio}
    elif mode == "indexed":
        scores = torch.randn(bs, n_ent, generator=g, device="cuda")
        ok = ids[None, :] < visible[:, None]
        scores = scores.masked_fill(~ok, float("-inf"))
        picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
        keys.append(entries[slots[:, None], picks])
        valid.append(ok.gather(1, picks))
        kwargs = {"entries": entries, "ratio": ratio, "picks": picks}
    ref = sink_attention(q, torch.cat(keys, 1), torch.cat(valid, 1), sink, scale)
    out = sparse_decode_attention(q, ring, slots, positions, sink, scale, **kwargs)  # type: ignore[arg-type]
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < TOL, (mode, _rel(out, ref))
    per_row = (out - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))
    assert float(per_row.max()) < 10 * TOL, per_row


@pytest.mark.parametrize("heads,dim", [(4, 32), (64, 128)])
def test_indexer_scores_match_torch(heads: int, dim: int) -> None:
    g = torch.Generator("cuda").manual_seed(heads * dim)
    n_ent, slots_total = 1025, 9
    keys = _pool((slots_total, n_ent, dim), g)
    visible = torch.tensor([0, 1, 5, 63, 64, 65, 700, 1024, 1025], device="cuda")
    bs = visible.numel()
    slots = torch.randperm(slots_total, generator=g, device="cuda")
    q = _pool((bs, heads, dim), g)
    w = torch.randn(bs, heads, generator=g, device="cuda")
    scale = dim**-0.5
    dots = torch.einsum("qhd,qnd->qhn", q.float(), keys[slots].float()).relu() * scale
    ref = (dots * w.unsqueeze(-1)).sum(dim=1)
    ok = torch.arange(n_ent, device="cuda")[None, :] < visible[:, None]
    ref = ref.masked_fill(~ok, float("-inf"))
    out = indexer_scores(q, w, keys, slots, visible, scale)
    assert torch.equal(torch.isinf(out), ~ok)
    err = (out[ok] - ref[ok]).abs().max()
    assert float(err) <= TOL * float(ref[ok].abs().max()), float(err)


def test_compressor_projection_fp32_output_matches_upcast() -> None:
    from sglang.srt.layers.attention.dsv4_compressor import _fp32_matmul

    g = torch.Generator("cuda").manual_seed(11)
    for rows in (1, 16, 300):
        x = _pool((rows, 4096), g)
        w = _pool((1024, 4096), g) * 0.02
        got = _fp32_matmul(x, w)
        ref = x.float() @ w.float().t()
        assert got.dtype == torch.float32
        assert _rel(got, ref) < 1e-5, _rel(got, ref)


def test_model_static_decode_kernels_match_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.default_model.config import default_model_config
    from sglang.srt.default_model.generate import random_weights
    from sglang.srt.layers.build_spec import LayerBuildSpec
    from sglang.srt.model_loader.deepseek_v4_loader import load_weights
    from sglang.srt.model_loader.load_options import LoadOptions
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig

    vocab = 512
    raw = default_model_config(vocab, 0, 1)
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict(raw), LayerBuildSpec(dtype=torch.bfloat16, device="cuda")
    )
    load_weights(model, random_weights(raw, seed=3), LoadOptions(progress=False))
    model.eval()
    model.enable_slot_pool(max_slots=12, capacity=512)  # two caches per length
    lengths = (3, 30, 31, 100, 127, 250)  # before, at and past the window (32) and block edges
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, vocab, (n + 1,), generator=gen).cuda() for n in lengths]
    fast = [model.new_pooled_cache() for _ in lengths]
    slow = [model.new_pooled_cache() for _ in lengths]
    for seq, n, a, b in zip(seqs, lengths, fast, slow):
        model.prefill(seq[:n], a)
        model.prefill(seq[:n], b)
    # One step from identical caches: a longer run would compound bf16 rounding of summation-order
    # differences through the random layers (20 steps drifted to a mean relative error of 0.09).
    ids = torch.stack([seq[n] for seq, n in zip(seqs, lengths)])
    calls: list[bool] = []
    monkeypatch.setenv("SGLANG_DSV4_LENGTH_AWARE_DECODE", "1")
    real = dsv4_static_decode.use_sparse_kernels
    monkeypatch.setattr(
        dsv4_static_decode, "use_sparse_kernels", lambda *a: calls.append(real(*a)) or real(*a)
    )
    got = model.decode_pooled(ids, fast).clone()
    monkeypatch.setattr(dsv4_static_decode, "use_sparse_kernels", lambda *a: False)
    want = model.decode_pooled(ids, slow)
    assert calls and all(calls), "the kernels must have run"
    assert torch.isfinite(got).all()
    rel = float((got - want).abs().mean() / want.abs().mean())
    assert rel < 1e-2, rel
    assert int((got.argmax(-1) == want.argmax(-1)).sum()) >= len(lengths) - 1


if __name__ == "__main__":
    run_this_file(__file__)
