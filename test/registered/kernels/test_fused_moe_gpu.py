"""The fused-MoE Triton kernels on a GPU against the torch reference, at the real model shapes.

DeepSeek V4 experts (E=256, top-6, H=4096, I=2048, clamped SwiGLU) and Kimi K3 latent experts
(E=384, top-16, H=3584, I=3072, SiTU), bf16 and FP8 (128x128 block scales), M in (1, 7, 64, 512),
both activations. Inputs are fresh random values (never zeros); some slots are masked (-1) and one
token has every slot masked. Outputs are poisoned with NaN first, and so is the allocator's cached
memory, so a row the kernels forget to write shows up. The reference quantises exactly like the
kernels, so FP8 is checked against its own quantised reference.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cuda_ci
from sglang.test.moe_model_cases import (
    ACTIVATIONS,
    FP8_TOL,
    REFERENCE_GRID,
    REFERENCE_IDS,
    SHAPES,
    expert_weights,
    poison_moe_workspace,
    reference_cases,
    refill_and_replay,
    routing,
)
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_norm_err

register_cuda_ci(est_time=30, suite="h200-1gpu")


@pytest.mark.parametrize(("shape_name", "fp8", "m"), REFERENCE_GRID, ids=REFERENCE_IDS)
def test_fused_experts_matches_reference(shape_name: str, fp8: bool, m: int) -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts

    shape = SHAPES[shape_name]
    for case in reference_cases(shape_name, fp8, m):
        hidden, topk_w, topk_ids, kw = case.hidden, case.topk_weights, case.topk_ids, case.kwargs
        poison_moe_workspace(m, shape, hidden.device)
        out = torch.full_like(hidden, float("nan"))
        got = fused_experts(hidden, topk_weights=topk_w, topk_ids=topk_ids, out=out, **kw)
        torch.cuda.synchronize()
        assert got.data_ptr() == out.data_ptr(), "out= must receive the result"
        case.check(out)

        buf = hidden.clone()
        poison_moe_workspace(m, shape, hidden.device)
        got = fused_experts(buf, topk_weights=topk_w, topk_ids=topk_ids, inplace=True, **kw)
        torch.cuda.synchronize()
        assert got.data_ptr() == buf.data_ptr(), "inplace=True must write into hidden"
        assert torch.isfinite(buf).all()
        assert rel_norm_err(buf, case.want) < case.tol

        fresh = fused_experts(hidden, topk_weights=topk_w, topk_ids=topk_ids, **kw)
        assert fresh.data_ptr() not in (hidden.data_ptr(), out.data_ptr())
        assert rel_norm_err(fresh, case.want) < case.tol


@pytest.mark.parametrize("m", (1, 37, 512))
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_fp8_tuned_and_rule_tiles_match_reference(shape_name: str, m: int) -> None:
    """The two-launch FP8 GEMMs on the tuned tiles of this size and on the rule's, against the
    torch reference, with the allocator and the output poisoned."""
    from sglang.kernels.ops.moe.fused_moe import (
        FusedMoeConfig,
        check_moe_inputs,
        fused_experts,
        fused_experts_torch,
        get_config,
        select_chunk_config,
    )

    shape = SHAPES[shape_name]
    weights = expert_weights(shape, True)
    hidden, topk_w, topk_ids = routing(m, shape, seed=900 + m)
    kw = dict(weights, activation=ACTIVATIONS[shape_name][0][0], swiglu_limit=None)
    p = check_moe_inputs(
        hidden, weights["w13"], weights["w2"], topk_w, topk_ids,
        weights["w13_scale"], weights["w2_scale"], (128, 128), None,
    )  # fmt: skip
    want = fused_experts_torch(hidden, topk_weights=topk_w, topk_ids=topk_ids, **kw)
    tuned = select_chunk_config(m, p, weights["w13"].dtype, hidden.device)
    rule = get_config(m, shape.experts, shape.hidden, shape.inter, weights["w13"].dtype,
                      top_k=shape.top_k)  # fmt: skip
    for cfg in {tuned, rule}:  # the rule's tiles are always two-launch
        if not isinstance(cfg, FusedMoeConfig):
            continue  # a TMA bucket: its own test file
        poison_moe_workspace(m, shape, hidden.device, extra=0)
        out = torch.full_like(hidden, float("nan"))
        fused_experts(hidden, topk_weights=topk_w, topk_ids=topk_ids, out=out, config=cfg, **kw)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"{shape_name} M={m} {cfg}"
        assert rel_norm_err(out, want) < FP8_TOL, f"{shape_name} M={m} {cfg}"


def test_fused_experts_cuda_graph_replay() -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts

    shape = SHAPES["dsv4"]
    weights = expert_weights(shape, False)
    kw = dict(weights, activation="swiglu", swiglu_limit=shape.swiglu_limit)
    hidden, topk_w, topk_ids = routing(16, shape, seed=7)
    out = torch.empty_like(hidden)
    fused_experts(hidden, topk_weights=topk_w, topk_ids=topk_ids, out=out, **kw)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(hidden, topk_weights=topk_w, topk_ids=topk_ids, out=out, **kw)
    for seed in (8, 9):
        h2, w2, i2 = routing(16, shape, seed=seed)
        refill_and_replay(graph, (hidden, topk_w, topk_ids), (h2, w2, i2), out)
        eager = fused_experts(h2, topk_weights=w2, topk_ids=i2, **kw)
        assert torch.isfinite(out).all()
        assert rel_norm_err(out, eager) < 1e-6, "replay must equal an eager run on the same inputs"


def test_zero_tokens() -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts

    shape = SHAPES["dsv4"]
    weights = expert_weights(shape, False)
    hidden = torch.empty(0, shape.hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.empty(0, shape.top_k, device="cuda", dtype=torch.int32)
    out = fused_experts(hidden, topk_weights=ids.float(), topk_ids=ids, **weights)
    assert out.shape == hidden.shape


@pytest.mark.parametrize(
    "tokens,top_k,experts,block_m",
    [(1, 6, 256, 16), (7, 16, 384, 16), (512, 6, 256, 64), (4096, 16, 384, 128)],
)
def test_align_kernel_matches_torch(tokens: int, top_k: int, experts: int, block_m: int) -> None:
    from sglang.kernels.ops.moe.align import moe_align_block_size, moe_align_block_size_torch

    g = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.topk(torch.rand(tokens, experts, device="cuda", generator=g), top_k).indices
    ids = torch.where(torch.rand(ids.shape, device="cuda", generator=g) < 0.05, -1, ids).to(
        torch.int32
    )
    got = moe_align_block_size(ids, block_m, experts)
    want = moe_align_block_size_torch(ids, block_m, experts)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    # The kernel's order inside an expert's segment is free (atomics), so a segment that spans
    # several blocks may split its rows differently; the set of rows per expert is fixed.
    blocks_got, blocks_want = got[0].view(-1, block_m), want[0].view(-1, block_m)
    for expert in torch.unique(want[1]).tolist():
        rows_got = blocks_got[got[1] == expert].flatten().sort().values
        rows_want = blocks_want[want[1] == expert].flatten().sort().values
        assert torch.equal(rows_got, rows_want), f"expert {expert}"


@pytest.mark.parametrize("top_k,experts,block_m", [(6, 256, 16), (16, 384, 16), (16, 384, 64)])
def test_align_one_token_kernel_matches_torch(top_k: int, experts: int, block_m: int) -> None:
    from sglang.kernels.ops.moe.align import moe_align_one_token

    g = torch.Generator(device="cuda").manual_seed(top_k)
    ids = torch.topk(torch.rand(1, experts, device="cuda", generator=g), top_k).indices
    ids = ids.to(torch.int32)
    ids[0, 2] = -1
    got = moe_align_one_token(ids, block_m, experts)
    want = moe_align_one_token(ids.cpu(), block_m, experts)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.cpu(), b)


def test_group_quant_kernel_matches_torch() -> None:
    from sglang.kernels.ops.quant.fp8 import per_token_group_quant_fp8

    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16) * 3
    x[5, :128] = 0
    q_t, s_t = per_token_group_quant_fp8(x, 128)
    q_r, s_r = per_token_group_quant_fp8(x, 128, use_triton=False)
    torch.testing.assert_close(s_t, s_r, rtol=1e-6, atol=0)
    a, b = q_t.float(), q_r.float()
    diff = a != b
    # Division may round differently in the last bit, tipping a rare value one fp8 step.
    assert diff.float().mean() < 1e-3
    assert ((a[diff] - b[diff]).abs() <= b[diff].abs() * 0.126 + 2.0**-9).all()


@pytest.mark.parametrize("activation,limit", [("swiglu", None), ("swiglu", 1.5), ("situ", None)])
def test_activation_kernel(activation: str, limit: float | None) -> None:
    from sglang.kernels.ops.activation import act_and_mul_triton

    x = torch.randn(37, 2 * 3072, device="cuda") * 5
    got = act_and_mul_triton(x, activation, limit)
    gate, up = x.double().chunk(2, -1)
    if activation == "situ":
        want = 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * 25 * torch.tanh(up / 25)
    else:
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        want = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    got_b = act_and_mul_triton(x.bfloat16(), activation, limit)
    assert got_b.dtype == torch.bfloat16 and rel_norm_err(got_b, want) < 1e-2


if __name__ == "__main__":
    run_this_file(__file__)
