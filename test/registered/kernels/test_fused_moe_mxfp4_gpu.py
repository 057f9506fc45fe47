"""The MXFP4 W4A16 fused MoE on the GPU, at the real expert shapes.

DeepSeek V4 experts (E=256, top-6, H=4096, I=2048) and Kimi K3 latent experts (E=384 of its 896,
top-16, H=3584, I=3072), random MXFP4 weights (every code, scales over four octaves), M from 1 to
8192, both activations (clamped SwiGLU, SiTU), some slots masked and one token fully masked.
Outputs and the allocator's cached memory are poisoned with NaN first, so a row the kernels forget
shows up. Checked:
- the inline-PTX dequantisation on the device, bit for bit, for every code and every scale byte it
  claims exact (the E2M1 0.5s are bf16 subnormals on the way: a flush to zero would show);
- against the torch oracle (each expert dequantised exactly, fp32 GEMMs) within bf16 tolerance,
  and against ``fused_experts`` run on the dequantised bf16 weights (the same maths: within bf16
  rounding), with ``out`` / ``inplace`` / a fresh result;
- the prepared and the MegaMoE layouts give the plain layout's result bit for bit (the MegaMoE
  bytes built by the engine's builder with the real DeepGEMM where it loads, else in torch);
- both GEMM kernels (split and dot-order, ``Mxfp4MoeConfig.kernel``) at decode sizes, whichever
  the default rule picks;
- CUDA-graph capture and replay equals eager runs on new inputs; fp16 activations; zero tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton
import triton.language as tl

from sglang.kernels.ops.moe import mxfp4_operand as mxop
from sglang.test.ci_register import register_cuda_ci
from sglang.test.moe_model_cases import SHAPES, Shape, poison_moe_workspace
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_norm_err

register_cuda_ci(est_time=95, suite="h200-1gpu")

ORACLE_TOL = 2e-2  # bf16 outputs against the fp32-GEMM oracle
BF16_RUNNER_TOL = 1e-2  # against fused_experts on the same (dequantised) weights
M_VALUES = (1, 2, 7, 64, 512, 2048, 8192)


# Each model's own activation first; DeepSeek V4's SwiGLU clamped at 10.
MXFP4_ACTIVATIONS: dict[str, tuple[tuple[str, float | None], ...]] = {
    "dsv4": (("swiglu", 10.0), ("situ", None)),
    "k3": (("situ", None), ("swiglu", None)),
}


_CACHE: dict[str, dict[str, Any]] = {}


def experts(shape: Shape) -> dict[str, Any]:
    """Random MXFP4 experts of one shape (and their bf16 dequantisation), one shape at a time."""
    if shape.name not in _CACHE:
        _CACHE.clear()
        torch.cuda.empty_cache()
        from sglang.kernels.ops.moe.mxfp4_weights import Mxfp4MoeWeights
        from sglang.test.mxfp4_experts import random_mxfp4_experts

        w13, w2, s13, s2 = random_mxfp4_experts(
            shape.experts, shape.hidden, shape.inter, seed=1234, device="cuda"
        )
        weights = Mxfp4MoeWeights(w13, w2, s13, s2)
        b13, b2 = weights.dequantized(torch.bfloat16)
        _CACHE[shape.name] = {"weights": weights, "bf16": (b13, b2)}
    return _CACHE[shape.name]


def routing(m: int, shape: Shape, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from sglang.test.mxfp4_experts import random_routing

    x, tw, ids = random_routing(
        m, shape.hidden, shape.experts, shape.top_k, seed=seed, device="cuda", masked=0.05
    )
    if m > 2:
        ids[m // 2] = -1  # a token with every slot masked must come out as zeros
    return x, tw, ids


# --------------------------------------------------------------------------------------------
# The dequantisation itself
# --------------------------------------------------------------------------------------------


@triton.jit
def _dequant_kernel(packed_ptr, scales_ptr, out_ptr, ASM: tl.constexpr, ROWS: tl.constexpr):
    r = tl.arange(0, ROWS)
    packed = tl.load(packed_ptr + r[:, None] * 64 + tl.arange(0, 64)[None, :])
    scales = tl.load(scales_ptr + r[:, None] * 4 + tl.arange(0, 4)[None, :])
    tile = mxop.weight_tile(packed, scales, ROWS, tl.bfloat16, ASM)
    tl.store(out_ptr + r[:, None] * 128 + tl.arange(0, 128)[None, :], tile.to(tl.float32))


def test_inline_ptx_dequant_is_exact() -> None:
    """Rows of 128 values covering all 16 codes in every group, times every scale byte from 64
    to 190 (2**-63 .. 2**63): the fast path's tile times 2**62 equals the portable path's (fp32
    construction) and the torch reference, bit for bit."""
    from sglang.kernels.ops.quant.mxfp4 import dequant_mxfp4

    rows = 64
    g = torch.Generator(device="cuda").manual_seed(0)
    codes = torch.randint(0, 16, (rows, 4, 32), generator=g, device="cuda")
    codes[:, :, :16] = torch.arange(16, device="cuda")  # every code in every group
    codes[1::2, :, :16] = codes[1::2, :, :16].flip(-1)  # at even and odd positions
    codes = codes.reshape(rows, 128)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).contiguous()
    for offset in (0, 63):  # 256 (row, group) pairs a pass: every scale byte in [64, 190]
        sbytes = (64 + (offset + torch.arange(4 * rows, device="cuda")) % 127).to(torch.uint8)
        sbytes = sbytes.view(rows, 4).contiguous()
        fast = torch.empty(rows, 128, device="cuda")
        portable = torch.empty(rows, 128, device="cuda")
        _dequant_kernel[(1,)](packed, sbytes, fast, ASM=True, ROWS=rows)
        _dequant_kernel[(1,)](packed, sbytes, portable, ASM=False, ROWS=rows)
        want = dequant_mxfp4(packed, sbytes, torch.float32)
        assert torch.isfinite(fast).all()
        fast = fast * mxop.ASM_ACC_SCALE
        assert torch.equal(fast, portable), f"offset {offset}"
        # both tiles are in dot order (a permutation within each row): compare sorted rows
        assert torch.equal(fast.sort(-1).values, want.sort(-1).values), f"offset {offset}"


# --------------------------------------------------------------------------------------------
# The fused MoE
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_matches_oracle_and_bf16_runner(shape_name: str, m: int) -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts
    from sglang.kernels.ops.moe.fused_moe_mxfp4 import (
        fused_experts_mxfp4_weights,
        fused_experts_mxfp4_weights_torch,
    )

    shape = SHAPES[shape_name]
    cache = experts(shape)
    weights, (b13, b2) = cache["weights"], cache["bf16"]
    for n, (activation, limit) in enumerate(MXFP4_ACTIVATIONS[shape.name]):
        if n and m in (2, 2048):
            continue  # the second activation at a few sizes only
        x, tw, ids = routing(m, shape, seed=m * 10 + n)
        kw: dict[str, Any] = {"activation": activation, "swiglu_limit": limit}
        want = fused_experts_mxfp4_weights_torch(x, weights, tw, ids, **kw)
        assert torch.isfinite(want).all() and want.abs().sum() > 0
        tag = f"{shape_name} M={m} {activation}"

        poison_moe_workspace(m, shape, "cuda")
        out = torch.full_like(x, float("nan"))
        got = fused_experts_mxfp4_weights(x, weights, tw, ids, out=out, **kw)
        torch.cuda.synchronize()
        assert got.data_ptr() == out.data_ptr(), "out= must receive the result"
        assert torch.isfinite(out).all(), f"{tag}: unwritten or NaN rows"
        err = rel_norm_err(out, want)
        assert err < ORACLE_TOL, f"{tag}: rel err {err:.3g} against the oracle"
        if m > 2:
            assert (out[m // 2] == 0).all(), "a fully masked token must be zero"

        bf16 = fused_experts(x, b13, b2, tw, ids, **kw)
        err = rel_norm_err(out, bf16)
        assert err < BF16_RUNNER_TOL, f"{tag}: rel err {err:.3g} against fused_experts on bf16"

        buf = x.clone()
        poison_moe_workspace(m, shape, "cuda")
        got = fused_experts_mxfp4_weights(buf, weights, tw, ids, inplace=True, **kw)
        torch.cuda.synchronize()
        assert got.data_ptr() == buf.data_ptr(), "inplace=True must write into hidden"
        assert torch.equal(buf, out), f"{tag}: in place differs from out="
        fresh = fused_experts_mxfp4_weights(x, weights, tw, ids, **kw)
        assert fresh.data_ptr() not in (x.data_ptr(), out.data_ptr())
        assert torch.equal(fresh, out)
        print(f"{tag}: rel err {rel_norm_err(out, want):.2e} (oracle), {err:.2e} (bf16 runner)")


def _mega_layout(weights: Any) -> Any:
    """The MegaMoE bytes: the engine's builder with the real DeepGEMM when it loads and lays
    out MXFP4 scales on this GPU (checked equal to the torch layout), else the torch layout."""
    from sglang.kernels.ops.moe.mxfp4_weights import mega_moe_layout_of, mega_moe_mxfp4_weights

    ours = mega_moe_layout_of(weights)
    try:
        import deep_gemm

        from sglang.srt.layers.moe.mega_moe_weights import build_mega_moe_experts_weights

        l1, l2 = build_mega_moe_experts_weights(
            deep_gemm, weights.w13, weights.w2, weights.w13_scale, weights.w2_scale
        )
    except Exception as err:  # noqa: BLE001 -- no DeepGEMM, or no SM90 MXFP4 scale layout
        print(f"MegaMoE bytes from the torch layout ({type(err).__name__}: {err})"[:200])
        return ours
    built = mega_moe_mxfp4_weights(l1, l2)
    for a, b in zip(built.kernel_operands, ours.kernel_operands, strict=True):
        assert torch.equal(a, b), "DeepGEMM's MegaMoE layout differs from the torch one"
    return built


@pytest.mark.parametrize("m", (1, 64, 2048))
def test_layouts_give_the_plain_result(m: int) -> None:
    from sglang.kernels.ops.moe.fused_moe_mxfp4 import fused_experts_mxfp4_weights
    from sglang.kernels.ops.moe.mxfp4_weights import prepare_mxfp4_moe_weights

    shape = SHAPES["dsv4"]
    weights = experts(shape)["weights"]
    prepared = prepare_mxfp4_moe_weights(
        weights.w13, weights.w2, weights.w13_scale, weights.w2_scale
    )
    mega = _mega_layout(weights)
    x, tw, ids = routing(m, shape, seed=77 + m)
    want = fused_experts_mxfp4_weights(x, weights, tw, ids, swiglu_limit=10.0)
    for name, other in (("prepared", prepared), ("mega", mega)):
        got = fused_experts_mxfp4_weights(x, other, tw, ids, swiglu_limit=10.0)
        assert torch.equal(got, want), f"{name} layout, M={m}"
    del prepared, mega
    torch.cuda.empty_cache()


@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_both_kernels_at_decode_sizes(shape_name: str) -> None:
    """Whichever kernel the default rule or a table picks, both must be right: the split kernel
    at several tiles (64, 32 and 16 weight rows, the hidden states reordered in GEMM 1 or ahead
    of it) and the dot-order kernel's decode tiles, against the oracle, each other, and (split)
    the MegaMoE layout bit for bit."""
    from sglang.kernels.ops.moe.fused_moe_mxfp4 import (
        fused_experts_mxfp4_weights,
        fused_experts_mxfp4_weights_torch,
    )
    from sglang.kernels.ops.moe.mxfp4_config import Mxfp4GemmTile as T
    from sglang.kernels.ops.moe.mxfp4_config import Mxfp4MoeConfig

    shape = SHAPES[shape_name]
    weights = experts(shape)["weights"]
    mega = _mega_layout(weights)
    dot = Mxfp4MoeConfig(16, T(64, 1, 4, 4), T(128, 1, 4, 4))
    splits = [
        Mxfp4MoeConfig(16, T(32, 1, 4, 6), T(64, 1, 4, 6), kernel="split"),
        Mxfp4MoeConfig(16, T(16, 1, 2, 6), T(32, 1, 2, 6), kernel="split"),
        Mxfp4MoeConfig(16, T(8, 1, 1, 8), T(16, 1, 1, 8), x_in_dot_order=True, kernel="split"),
    ]
    activation, limit = MXFP4_ACTIVATIONS[shape.name][0]
    kw: dict[str, Any] = {"activation": activation, "swiglu_limit": limit}
    for m in (1, 4, 16, 64):
        x, tw, ids = routing(m, shape, seed=500 + m)
        want = fused_experts_mxfp4_weights_torch(x, weights, tw, ids, **kw)
        ref = fused_experts_mxfp4_weights(x, weights, tw, ids, config=dot, **kw)
        assert rel_norm_err(ref, want) < ORACLE_TOL, f"{shape_name} M={m} dot-order"
        for n, cfg in enumerate(splits):
            poison_moe_workspace(m, shape, "cuda")
            got = fused_experts_mxfp4_weights(x, weights, tw, ids, config=cfg, **kw)
            torch.cuda.synchronize()
            tag = f"{shape_name} M={m} {cfg}"
            assert torch.isfinite(got).all(), f"{tag}: unwritten or NaN rows"
            assert rel_norm_err(got, want) < ORACLE_TOL, (
                f"{tag}: {rel_norm_err(got, want):.3g} (oracle)"
            )
            assert rel_norm_err(got, ref) < BF16_RUNNER_TOL, (
                f"{tag}: {rel_norm_err(got, ref):.3g} (dot)"
            )
            if m > 2:
                assert (got[m // 2] == 0).all(), f"{tag}: a fully masked token must be zero"
            if n == 0:
                on_mega = fused_experts_mxfp4_weights(x, mega, tw, ids, config=cfg, **kw)
                assert torch.equal(on_mega, got), f"{tag}: MegaMoE layout differs"
    del mega
    torch.cuda.empty_cache()


@pytest.mark.parametrize("m", (1, 16, 512))
def test_cuda_graph_replay(m: int) -> None:
    from sglang.kernels.ops.moe.fused_moe_mxfp4 import fused_experts_mxfp4_weights

    shape = SHAPES["dsv4"]
    weights = experts(shape)["weights"]
    x, tw, ids = routing(m, shape, seed=5)
    out = torch.empty_like(x)
    fused_experts_mxfp4_weights(x, weights, tw, ids, out=out, swiglu_limit=10.0)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts_mxfp4_weights(x, weights, tw, ids, out=out, swiglu_limit=10.0)
    for seed in (8, 9):
        x2, tw2, ids2 = routing(m, shape, seed=seed)
        x.copy_(x2)
        tw.copy_(tw2)
        ids.copy_(ids2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = fused_experts_mxfp4_weights(x2, weights, tw2, ids2, swiglu_limit=10.0)
        assert torch.isfinite(out).all()
        assert rel_norm_err(out, eager) < 1e-6, "replay must equal an eager run on the same inputs"


def test_fp16_activations_and_zero_tokens() -> None:
    from sglang.kernels.ops.moe.fused_moe_mxfp4 import (
        fused_experts_mxfp4_weights,
        fused_experts_mxfp4_weights_torch,
    )

    shape = SHAPES["dsv4"]
    weights = experts(shape)["weights"]
    for m in (7, 300):
        x, tw, ids = routing(m, shape, seed=31 + m)
        x = x.half()
        want = fused_experts_mxfp4_weights_torch(x, weights, tw, ids, swiglu_limit=10.0)
        got = fused_experts_mxfp4_weights(x, weights, tw, ids, swiglu_limit=10.0)
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        assert rel_norm_err(got, want) < ORACLE_TOL, f"fp16 M={m}"
    empty = torch.empty(0, shape.hidden, device="cuda", dtype=torch.bfloat16)
    ids0 = torch.empty(0, shape.top_k, device="cuda", dtype=torch.int32)
    assert fused_experts_mxfp4_weights(empty, weights, ids0.float(), ids0).shape == empty.shape


if __name__ == "__main__":
    run_this_file(__file__)
