"""DeepGEMM's SM90 MegaMoE (``fp8_mega_moe``, sgl-deep-gemm 0.1.5.post1) for real, through
DeepSeek V4's own ``DeepseekV4MoE._run_mega_routed``, and the reserved-SM regression on Hopper.

- FP8 experts laid out by ``transform_weights_for_mega_moe_sm90``, pre-dispatch into the cached
  torch-symmetric-memory buffer (one rank), the kernel on the reserved budget: equals the normal
  path (Triton runner on the same FP8 experts + the shared expert) at the DSv4 expert shape;
- the call captures in a CUDA graph and replays what eager computes;
- SiTU and I > 4096 go to our Triton kernel, with the reason;
- a side-stream kernel holding 1 or 2 whole SMs for longer than the MegaMoE call: at the default
  reserve (2) no launch of 100 waits for it; with the reserve at 0 most launches do. The counts
  are printed (docs/performance.md quotes them).
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.test.ci_register import register_cuda_ci
from sglang.test.real_deep_gemm import deep_gemm_or_skip
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_norm_err

register_cuda_ci(est_time=80, suite="h200-1gpu")

HOLD_MS = 20.0
LAUNCHES = 100


@pytest.fixture(scope="module")
def dg():  # type: ignore[no-untyped-def]
    dg = deep_gemm_or_skip()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the SM90 MegaMoE needs a Hopper GPU")
    return dg


def _layer(dg, *, hidden: int, inter: int, experts: int, top_k: int, seed: int):  # type: ignore[no-untyped-def]
    """A DSv4 MoE layer (bf16, megamoe a2a) with random FP8 128x128 experts and MegaMoE weights
    built the way the loader builds them."""
    from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8
    from sglang.srt.layers.moe.expert_weights import ExpertWeights
    from sglang.srt.layers.moe.mega_moe_weights import build_mega_moe_experts_weights
    from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
    from sglang.srt.models.deepseek_v4_moe import DeepseekV4MoE

    config = DeepseekV4ModelConfig.from_dict(
        {
            "vocab_size": 64,
            "hidden_size": hidden,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 64,
            "qk_rope_head_dim": 16,
            "q_lora_rank": 64,
            "o_lora_rank": 32,
            "o_groups": 2,
            "sliding_window": 8,
            "compress_ratios": [0, 0],
            "num_hash_layers": 0,
            "index_n_heads": 2,
            "index_head_dim": 32,
            "n_routed_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": inter,
            "n_shared_experts": 1,
            "swiglu_limit": 7.0,
            "routed_scaling_factor": 1.5,
        }
    )
    moe = DeepseekV4MoE(
        config,
        1,
        LayerBuildSpec(
            dtype=torch.bfloat16, moe_runner="triton", a2a_backend="megamoe", device="cuda"
        ),
    )
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=gen) * p.shape[-1] ** -0.5)
    q13, s13 = block_quant_weight_fp8(
        torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden**-0.5,
        (128, 128),
    )
    q2, s2 = block_quant_weight_fp8(
        torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter**-0.5, (128, 128)
    )
    moe.experts.load_local_weights(ExpertWeights(q13, q2, s13, s2))
    moe.experts.set_mega_weights(build_mega_moe_experts_weights(dg, q13, q2, s13, s2))
    return moe


def _inputs(moe, t: int, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = moe.experts.config.hidden_size
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    return x, torch.randint(0, 64, (t,), device="cuda", generator=gen)


def _run_mega(moe, x, ids, shared):  # type: ignore[no-untyped-def]
    """``_run_mega_routed`` with the kernel the layer chooses for ``x``'s batch (as forward)."""
    kernel = moe.experts.mega_kernel_for(x)
    assert kernel is not None, "no MegaMoE kernel takes this batch"
    return moe._run_mega_routed(x, ids, shared, kernel)


@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_run_mega_routed_equals_the_normal_path(dg, t: int) -> None:  # type: ignore[no-untyped-def]
    from sglang.kernels.ops.moe.fused_moe import fused_experts
    from sglang.srt.layers.moe.a2a.mega_moe_a2a import choose_mega_kernel

    moe = _layer(dg, hidden=4096, inter=2048, experts=256, top_k=6, seed=1)
    x, ids = _inputs(moe, t, seed=t)
    choice = choose_mega_kernel(
        dg,
        None,
        x,
        moe.experts.mega_weights,
        moe.experts.mega_params,
        device=x.device,
        local_weights=moe.experts.weights,
    )
    assert choice.backend == "deep_gemm" and "fp8_mega_moe" in choice.why
    with torch.no_grad():
        shared = moe.shared_experts(x)
        got = moe._run_mega_routed(x, ids, shared, choice)
        topk = moe.route(x, ids)
        w = moe.experts.weights
        routed = fused_experts(
            x,
            w.w13,
            w.w2,
            topk.topk_weights,
            topk.topk_ids,
            activation="swiglu",
            swiglu_limit=7.0,
            w13_scale=w.w13_scale,
            w2_scale=w.w2_scale,
            block_shape=(128, 128),
        )
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    err = rel_norm_err(got, routed + shared)
    assert err < 3e-2, err  # FP8 intermediate in the kernel vs per-128 FP8 groups in Triton


def test_run_mega_routed_replays_in_a_cuda_graph(dg) -> None:  # type: ignore[no-untyped-def]
    moe = _layer(dg, hidden=1024, inter=512, experts=16, top_k=4, seed=2)
    x, ids = _inputs(moe, 8, seed=3)
    with torch.no_grad():
        _run_mega(moe, x, ids, None)  # buffer (a collective) and JIT outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _run_mega(moe, x, ids, None)
        for seed in (4, 5):
            x2, ids2 = _inputs(moe, 8, seed=seed)
            x.copy_(x2)
            ids.copy_(ids2)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            eager = _run_mega(moe, x2, ids2, None)
            assert torch.isfinite(out).all() and rel_norm_err(out, eager) < 1e-3


def test_situ_and_wide_intermediate_go_to_our_triton_kernel(dg) -> None:  # type: ignore[no-untyped-def]
    from sglang.srt.layers.moe import mega_moe
    from sglang.srt.layers.moe.a2a.mega_moe_a2a import choose_mega_kernel
    from sglang.srt.layers.moe.expert_weights import ExpertWeights

    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    local = ExpertWeights(
        torch.randn(8, 2 * 4224, 1024, device="cuda", dtype=torch.bfloat16),
        torch.randn(8, 1024, 4224, device="cuda", dtype=torch.bfloat16),
    )
    built = ((torch.empty(1), torch.empty(1)), (torch.empty(1), torch.empty(1)))
    for params, why in (
        (mega_moe.MegaMoEParams(8, 2, 1024, 512, activation="situ"), "SwiGLU only"),
        (mega_moe.MegaMoEParams(8, 2, 1024, 4224), "intermediate <= 4096"),
    ):
        choice = choose_mega_kernel(
            dg, None, x, built, params, device=x.device, local_weights=local
        )
        assert choice.backend == "triton" and why in choice.why, choice


def _waited(moe, x, ids, held: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Per launch: ms from just after ``held`` SMs are taken by a side-stream holder to the end of
    ``_run_mega_routed``."""
    from sglang.test.sm_holder import hold_sms

    side = torch.cuda.Stream()
    kernel = moe.experts.mega_kernel_for(x)
    assert kernel is not None
    times = []
    for _ in range(LAUNCHES):
        hold_sms(held, HOLD_MS, side, x.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        moe._run_mega_routed(x, ids, None, kernel)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def test_reserve_keeps_the_kernel_off_a_side_stream_holder(
    dg, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    from sglang.srt.environ import envs
    from sglang.test.sm_holder import cupy_available

    if not cupy_available():
        pytest.skip("the SM holder needs CuPy")
    moe = _layer(dg, hidden=1024, inter=512, experts=16, top_k=4, seed=6)
    x, ids = _inputs(moe, 64, seed=7)
    rows = []
    with torch.no_grad():
        for reserve in (2, 0):
            with envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.override(reserve):
                _run_mega(moe, x, ids, None)  # JIT for this SM count, outside the timing
                torch.cuda.synchronize()
                for held in (1, 2):
                    times = sorted(_waited(moe, x, ids, held))
                    stalls = sum(t > HOLD_MS / 2 for t in times)
                    rows.append((reserve, held, stalls, times[len(times) // 2], times[-1]))
    with capsys.disabled():
        print(
            f"\nSM90 fp8_mega_moe through _run_mega_routed, side-stream holder {HOLD_MS:.0f} ms, "
            f"{LAUNCHES} launches"
        )
        print("| reserve | SMs held | launches that waited | median ms | max ms |")
        for reserve, held, stalls, med, worst in rows:
            print(f"| {reserve} | {held} | {stalls}/{LAUNCHES} | {med:.3f} | {worst:.3f} |")
    by = {(r, h): s for r, h, s, _, _ in rows}
    assert by[(2, 1)] == 0 and by[(2, 2)] == 0, rows
    assert by[(0, 1)] >= LAUNCHES // 2 and by[(0, 2)] >= LAUNCHES // 2, rows


if __name__ == "__main__":
    run_this_file(__file__)
