"""The Hopper prefill MoE kernels (``grouped_gemm_tma.py``) on a GPU against the torch reference.

DeepSeek V4 experts (E=256 top-6 H=4096 I=2048, clamped SwiGLU) and Kimi K3 latent experts
(E=384 top-16 H=3584 I=3072, SiTU), bf16 and FP8 128x128, with configs forced (persistent and not,
block_m 64 and 128, every tile shape the tables may pick) at M values that are not multiples of
any tile, with masked slots, a fully masked token, and routings that leave most experts empty.
Outputs and the allocator's cache are poisoned with NaN first. FP8 is checked against the reference
that quantises the intermediate exactly like the fused gate-up epilogue.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sglang.test.ci_register import register_cuda_ci
from sglang.test.moe_model_cases import refill_and_replay
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_norm_err

register_cuda_ci(est_time=150, suite="h200-1gpu")

BF16_TOL = 2e-2
FP8_TOL = 6e-2
SHAPES = {"dsv4": (256, 6, 4096, 2048, "swiglu", 1.0), "k3": (384, 16, 3584, 3072, "situ", None)}
_CACHE: dict[tuple[str, bool], dict[str, Any]] = {}


def tma_configs(fp8: bool) -> list[Any]:
    from sglang.kernels.ops.moe.grouped_gemm_tma import TmaGemmTile as T
    from sglang.kernels.ops.moe.grouped_gemm_tma import TmaMoeConfig as C

    if fp8:
        return [
            C(128, T(128, 128, 16, 8, 3), T(128, 128, 16, 8, 3)),
            C(64, T(128, 128, 32, 4, 3, persistent=False), T(256, 128, 32, 8, 3)),
            C(64, T(256, 64, 8, 8, 3), T(128, 64, 8, 4, 4, persistent=False)),
            C(64, T(128, 128, 32, 8, 4, paired=True), T(256, 128, 32, 8, 3)),
            # One accumulator rescaled between K blocks, activations gathered or sorted first.
            C(64, T(128, 128, 32, 8, 4, rescale=True), T(128, 128, 32, 8, 4, rescale=True)),
            C(
                128,
                T(128, 128, 16, 8, 3, rescale=True),
                T(128, 128, 16, 8, 4, rescale=True),
                sorted_a=True,
            ),
            # Half tiles: an expert's last tile 64 (32) rows high where that covers it.
            C(
                128,
                T(128, 128, 16, 8, 3, rescale=True),
                T(128, 128, 16, 8, 4, rescale=True),
                sorted_a=True,
                half_tiles=True,
            ),
            C(64, T(128, 128, 32, 8, 4), T(256, 128, 32, 8, 3), half_tiles=True),
        ]
    return [
        C(128, T(128, 64, 16, 8, 4), T(256, 64, 16, 8, 3)),
        C(64, T(64, 64, 16, 4, 4, persistent=False), T(128, 64, 16, 4, 4)),
        C(128, T(128, 64, 16, 8, 4, paired=True), T(256, 64, 16, 8, 3)),
        C(128, T(128, 64, 16, 8, 4), T(256, 64, 16, 8, 3), sorted_a=True),
        C(128, T(128, 64, 16, 8, 4, paired=True), T(256, 64, 16, 8, 3), half_tiles=True),
        C(128, T(128, 64, 16, 8, 4), T(128, 64, 16, 8, 4), sorted_a=True, half_tiles=True),
    ]


def expert_weights(name: str, fp8: bool) -> dict[str, Any]:
    from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8

    if (name, fp8) not in _CACHE:
        _CACHE.clear()
        torch.cuda.empty_cache()
        e, _, h, i, _, _ = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(99)
        w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g)
        w13.mul_(1.0 / math.sqrt(h))
        w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g)
        w2.mul_(1.0 / math.sqrt(i))
        if fp8:
            q13, s13 = block_quant_weight_fp8(w13, (128, 128))
            q2, s2 = block_quant_weight_fp8(w2, (128, 128))
            _CACHE[(name, fp8)] = {"w13": q13, "w2": q2, "w13_scale": s13, "w2_scale": s2}
        else:
            _CACHE[(name, fp8)] = {"w13": w13, "w2": w2}
    return _CACHE[(name, fp8)]


def routing(m: int, name: str, seed: int, experts_used: int | None) -> tuple[torch.Tensor, ...]:
    e, k, h, _, _, _ = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
    scores = torch.rand(m, e, device="cuda", generator=g) + 0.05
    if experts_used is not None:
        scores[:, experts_used:] = -1.0  # most experts get no rows at all
    weights, ids = torch.topk(scores, k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).float()
    ids = torch.where(torch.rand(ids.shape, device="cuda", generator=g) < 0.05, -1, ids)
    if m > 2:
        ids[m // 2] = -1
    return hidden, weights, ids.to(torch.int32)


@pytest.mark.parametrize("m", [1, 37, 777, 2048])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", ["dsv4", "k3"])
def test_tma_path_matches_reference(name: str, fp8: bool, m: int) -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts, fused_experts_torch

    if name == "k3" and m not in (37, 2048):
        pytest.skip("K3 at two sizes keeps the run short; DSv4 covers the rest")
    _, _, _, _, activation, limit = SHAPES[name]
    weights = expert_weights(name, fp8)
    experts_used = 20 if m == 777 else None
    hidden, tw, ids = routing(m, name, seed=m + (7 if fp8 else 0), experts_used=experts_used)
    kw = dict(weights, activation=activation, swiglu_limit=limit)
    want = fused_experts_torch(hidden, topk_weights=tw, topk_ids=ids, **kw)
    assert torch.isfinite(want).all() and want.abs().sum() > 0
    for cfg in tma_configs(fp8):
        junk = torch.empty(m * 16 * 8192 * 4 + (1 << 24), dtype=torch.uint8, device="cuda")
        junk.fill_(0xFF)  # NaN bytes in bf16 and fp32 for whatever the kernels forget to write
        del junk
        out = torch.full_like(hidden, float("nan"))
        fused_experts(hidden, topk_weights=tw, topk_ids=ids, out=out, config=cfg, **kw)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"{cfg}: unwritten or NaN rows"
        err = rel_norm_err(out, want)
        assert err < (FP8_TOL if fp8 else BF16_TOL), f"{name} M={m} {cfg}: rel err {err:.3g}"
        if m > 2:
            assert (out[m // 2] == 0).all(), "a fully masked token must be zero"


@pytest.mark.parametrize(
    "name,fp8,m", [("k3", True, 512), ("dsv4", False, 3000), ("dsv4", True, 8192)]
)
def test_tuned_dispatch_matches_reference(name: str, fp8: bool, m: int) -> None:
    """``fused_experts`` as the engine calls it: the H200 table picks the kernel and tiles."""
    from sglang.kernels.ops.moe.fused_moe import fused_experts, fused_experts_torch

    _, _, _, _, activation, limit = SHAPES[name]
    weights = expert_weights(name, fp8)
    hidden, tw, ids = routing(m, name, seed=m, experts_used=None)
    kw = dict(weights, activation=activation, swiglu_limit=limit)
    want = fused_experts_torch(hidden, topk_weights=tw, topk_ids=ids, **kw)
    out = torch.full_like(hidden, float("nan"))
    fused_experts(hidden, topk_weights=tw, topk_ids=ids, out=out, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_norm_err(out, want) < (FP8_TOL if fp8 else BF16_TOL)


def test_fused_quant_epilogue_equals_separate_quant() -> None:
    """The gate-up epilogue's FP8 intermediate equals quantising its bf16 activation output."""
    from sglang.kernels.ops.activation import ACT_SWIGLU
    from sglang.kernels.ops.moe.align import moe_align_block_size
    from sglang.kernels.ops.moe.grouped_gemm_tma import TmaGemmTile, launch_gate_up_tma
    from sglang.kernels.ops.quant.fp8 import FP8_DTYPE, per_token_group_quant_fp8

    weights = expert_weights("dsv4", True)
    e, k, h, i, _, _ = SHAPES["dsv4"]
    hidden, _, ids = routing(300, "dsv4", seed=5, experts_used=None)
    x, xs = per_token_group_quant_fp8(hidden, 128)
    align = moe_align_block_size(ids, 64, e)
    p = align[0].shape[0]
    tile = TmaGemmTile(128, 128, 8, 4, 3)
    q = torch.full((p, i), float("nan"), device="cuda").to(FP8_DTYPE)
    s = torch.full((p, i // 128), float("nan"), device="cuda")
    args = (x, xs, weights["w13"], weights["w13_scale"])
    launch_gate_up_tma(
        *args,
        q,
        s,
        align,
        num_slots=300 * k,
        top_k=k,
        block_m=64,
        tile=tile,
        scale_block=128,
        act=ACT_SWIGLU,
        limit=1.0,
        num_sms=132,
    )
    used = int(align[2].item())
    deq = q[:used].float().view(used, -1, 128) * s[:used, :, None]
    assert torch.isfinite(deq).all()
    # Recompute the bf16 activation with the two-launch kernel's maths through torch.
    from sglang.kernels.ops.activation import act_and_mul_reference
    from sglang.kernels.ops.quant.fp8 import block_dequant_fp8

    rows = align[0][:used].long()
    real = rows < 300 * k
    xd = (x.float().view(300, -1, 128) * xs[:, :, None]).view(300, h)
    experts = align[1].repeat_interleave(64)[:used].long()
    ref = torch.zeros(used, i, device="cuda")
    for ex in torch.unique(experts[real]).tolist():
        sel = real & (experts == ex)
        w13 = block_dequant_fp8(weights["w13"][ex], weights["w13_scale"][ex], (128, 128))
        gu = xd[rows[sel] // k] @ w13.t()
        ref[sel] = act_and_mul_reference(gu, "swiglu", 1.0).bfloat16().float()
    rq, rs = per_token_group_quant_fp8(ref.bfloat16(), 128)
    want = rq.float().view(used, -1, 128) * rs[:, :, None]
    assert rel_norm_err(deq[real], want[real]) < 2e-2
    assert (deq[~real] == 0).all(), "padding rows quantise to zero"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_half_tiles_compute_each_row_as_whole_tiles(fp8: bool) -> None:
    """Half tiles change which rows share a tile, not a row's sums (same K loop, same
    accumulation order): the output equals the whole-tile one bit for bit, at a size where the
    table holds both tile heights; and fewer rows are computed."""
    from dataclasses import replace

    from sglang.kernels.ops.moe.align import moe_align_block_size, moe_align_half_tiles
    from sglang.kernels.ops.moe.fused_moe import fused_experts

    weights = expert_weights("dsv4", fp8)
    e = SHAPES["dsv4"][0]
    hidden, tw, ids = routing(8192, "dsv4", seed=21, experts_used=None)
    whole = next(
        c for c in tma_configs(fp8) if c.block_m == 128 and c.sorted_a and not c.half_tiles
    )
    kw = dict(weights, activation="swiglu", swiglu_limit=1.0)
    want = fused_experts(hidden, topk_weights=tw, topk_ids=ids, config=whole, **kw)
    out = torch.full_like(hidden, float("nan"))
    cfg = replace(whole, half_tiles=True)
    fused_experts(hidden, topk_weights=tw, topk_ids=ids, out=out, config=cfg, **kw)
    torch.cuda.synchronize()
    assert torch.equal(out, want), f"max diff {(out.float() - want.float()).abs().max().item()}"
    _, _, _, table, n = moe_align_half_tiles(ids, 128, e)
    halves = int(table[: int(n.item()), 2].sum())
    assert 0 < halves < int(n.item()), "both tile heights must run"
    rows_half = int(n.item()) * 128 - 64 * halves
    assert rows_half < int(moe_align_block_size(ids, 128, e)[2].item())


def test_tma_path_cuda_graph_replay() -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts

    weights = expert_weights("dsv4", True)
    kw = dict(weights, activation="swiglu", swiglu_limit=1.0, config=tma_configs(True)[0])
    hidden, tw, ids = routing(1024, "dsv4", seed=3, experts_used=None)
    out = torch.empty_like(hidden)
    fused_experts(hidden, topk_weights=tw, topk_ids=ids, out=out, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(hidden, topk_weights=tw, topk_ids=ids, out=out, **kw)
    h2, w2, i2 = routing(1024, "dsv4", seed=4, experts_used=None)
    refill_and_replay(graph, (hidden, tw, ids), (h2, w2, i2), out)
    eager = fused_experts(h2, topk_weights=w2, topk_ids=i2, **kw)
    assert torch.isfinite(out).all()
    assert rel_norm_err(out, eager) < 1e-6


if __name__ == "__main__":
    run_this_file(__file__)
