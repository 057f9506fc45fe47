"""Our Triton MegaMoE kernel on a GPU: correctness at the real model shapes, any grid size,
CUDA-graph replay, and the reserved-SM robustness cases.

Shapes, inputs and tolerances are those of the two-launch kernel's GPU test
(test_fused_moe_gpu.py): DeepSeek V4 (E=256, top-6, H=4096, I=2048) and Kimi K3 latent
(E=384, top-16, H=3584, I=3072), bf16 and FP8 128x128 blocks, both activations, fresh random
inputs with masked slots and one fully masked token, outputs and allocator poisoned with NaN.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cuda_ci
from sglang.test.moe_model_cases import (
    REFERENCE_GRID,
    REFERENCE_IDS,
    SHAPES,
    expert_weights,
    poison_moe_workspace,
    reference_cases,
    refill_and_replay,
    routing,
    tolerance,
)
from sglang.test.run import run_this_file
from sglang.test.sm_holder import cupy_available, hold_sms
from sglang.test.tolerance import rel_norm_err

register_cuda_ci(est_time=145, suite="h200-1gpu")


def budget() -> int:
    from sglang.srt.layers.moe.sm_budget import mega_moe_sm_budget

    return mega_moe_sm_budget() or torch.cuda.get_device_properties(0).multi_processor_count


def run_mega(hidden, topk_w, topk_ids, kw, *, num_sms=None, out=None, **extra):
    from sglang.kernels.ops.moe.mega_moe_triton import MegaMoELaunch, mega_fused_experts

    info: list[MegaMoELaunch] = []
    got = mega_fused_experts(
        hidden,
        topk_weights=topk_w,
        topk_ids=topk_ids,
        num_sms=num_sms or budget(),
        out=out,
        launch_info=info,
        **kw,
        **extra,
    )
    info[-1].check()
    return got, info[-1]


@pytest.mark.parametrize(("shape_name", "fp8", "m"), REFERENCE_GRID, ids=REFERENCE_IDS)
def test_mega_matches_reference(shape_name: str, fp8: bool, m: int) -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts

    shape = SHAPES[shape_name]
    for case in reference_cases(shape_name, fp8, m):
        hidden, topk_w, topk_ids, kw = case.hidden, case.topk_weights, case.topk_ids, case.kwargs
        two = fused_experts(hidden, topk_weights=topk_w, topk_ids=topk_ids, **kw)
        poison_moe_workspace(m, shape, hidden.device)
        out = torch.full_like(hidden, float("nan"))
        got, launch = run_mega(hidden, topk_w, topk_ids, kw, out=out)
        assert got.data_ptr() == out.data_ptr(), "out= must receive the result"
        case.check(out)
        # Same roundings as the two-launch kernel, so the two agree far better than either
        # agrees with the reference.
        assert rel_norm_err(out, two) < case.tol / 4
        assert int(launch.workspace.counters.abs().sum()) == 0, "counters must be re-armed"


@pytest.mark.parametrize("grid", [1, 2, 7, 64, 130, 264])
def test_any_grid_gives_the_same_bits(grid: int) -> None:
    shape = SHAPES["dsv4"]
    kw = dict(expert_weights(shape, False), activation="swiglu", swiglu_limit=shape.swiglu_limit)
    hidden, topk_w, topk_ids = routing(33, shape, seed=5)
    want, _ = run_mega(hidden, topk_w, topk_ids, kw)
    got, _ = run_mega(hidden, topk_w, topk_ids, kw, grid=grid)
    assert torch.equal(got, want), f"grid {grid} changed the result"


def test_cuda_graph_replay() -> None:
    shape = SHAPES["dsv4"]
    kw = dict(expert_weights(shape, True), activation="swiglu", swiglu_limit=shape.swiglu_limit)
    hidden, topk_w, topk_ids = routing(16, shape, seed=7)
    out = torch.empty_like(hidden)
    run_mega(hidden, topk_w, topk_ids, kw, out=out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_mega(hidden, topk_w, topk_ids, kw, out=out)  # warm up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        from sglang.kernels.ops.moe.mega_moe_triton import mega_fused_experts

        mega_fused_experts(
            hidden, topk_weights=topk_w, topk_ids=topk_ids, num_sms=budget(), out=out, **kw
        )
    for seed in (8, 9, 10):
        h2, w2, i2 = routing(16, shape, seed=seed)
        refill_and_replay(graph, (hidden, topk_w, topk_ids), (h2, w2, i2), out)
        eager, _ = run_mega(h2, w2, i2, kw)
        assert torch.equal(out, eager), "replay must equal an eager run on the same inputs"


@pytest.mark.skipif(not cupy_available(), reason="the SM holder needs CuPy")
def test_side_stream_holding_sms_never_hangs_or_corrupts() -> None:
    device = torch.device("cuda", 0)
    shape = SHAPES["dsv4"]
    kw = dict(expert_weights(shape, False), activation="swiglu", swiglu_limit=shape.swiglu_limit)
    hidden, topk_w, topk_ids = routing(8, shape, seed=11)
    want, _ = run_mega(hidden, topk_w, topk_ids, kw)
    side = torch.cuda.Stream(device)
    for held in (1, 2, 8):
        for _ in range(30):
            hold_sms(held, 3.0, side, device)
            got, _ = run_mega(hidden, topk_w, topk_ids, kw)
            assert torch.equal(got, want)


@pytest.mark.skipif(not cupy_available(), reason="the SM holder needs CuPy")
def test_forced_whole_grid_wait_reports_instead_of_hanging() -> None:
    from sglang.kernels.ops.grid_barrier import resident_ctas_per_sm
    from sglang.kernels.ops.moe.mega_moe_triton import MegaMoEWaitTimeout

    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    shape = SHAPES["dsv4"]
    kw = dict(expert_weights(shape, False), activation="swiglu", swiglu_limit=shape.swiglu_limit)
    hidden, topk_w, topk_ids = routing(8, shape, seed=12)
    want, launch = run_mega(hidden, topk_w, topk_ids, kw)
    c = launch.compiled
    per_sm = resident_ctas_per_sm(
        int(c.n_regs), int(c.metadata.shared), c.metadata.num_warps, props
    )
    side = torch.cuda.Stream(device)
    full = props.multi_processor_count * per_sm
    # Compile the barrier variant first: compiling after the hold starts would outlast it.
    got, _ = run_mega(
        hidden, topk_w, topk_ids, kw, grid=full, whole_grid_sync=True, timeout_ms=1000.0
    )
    assert torch.equal(got, want)
    hold_sms(1, 300.0, side, device)
    with pytest.raises(MegaMoEWaitTimeout, match="SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS"):
        run_mega(hidden, topk_w, topk_ids, kw, grid=full, whole_grid_sync=True, timeout_ms=50.0)
    torch.cuda.synchronize()
    # The budget leaves room for what is held: the same barrier completes, and the workspace
    # was cleaned after the error, so results are right again.
    hold_sms(2, 300.0, side, device)
    got, _ = run_mega(
        hidden,
        topk_w,
        topk_ids,
        kw,
        grid=budget() * per_sm,
        whole_grid_sync=True,
        timeout_ms=1000.0,
    )
    assert torch.equal(got, want)
    got, _ = run_mega(hidden, topk_w, topk_ids, kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_moe_layer_megamoe_backend_runs_the_triton_kernel(
    fp8: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--moe-a2a-backend megamoe`` on one Hopper GPU without DeepGEMM: the layer takes our
    kernel (not the fallback) and gives the normal path's result."""
    import sglang.srt.layers.moe.mega_moe_triton_backend as backend
    from sglang.srt.layers.moe.expert_weights import ExpertWeights
    from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
    from sglang.srt.layers.moe.topk import TopKOutput

    shape = SHAPES["dsv4"]
    w = expert_weights(shape, fp8)
    full = ExpertWeights(w["w13"], w["w2"], w.get("w13_scale"), w.get("w2_scale"))
    calls = []
    real = backend.run_triton_mega_routed
    monkeypatch.setattr(
        backend, "run_triton_mega_routed", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    outs = {}
    for a2a in ("none", "megamoe"):
        cfg = FusedMoEConfig(
            shape.experts,
            shape.hidden,
            shape.inter,
            shape.top_k,
            "swiglu",
            shape.swiglu_limit,
            "triton",
            a2a,
        )
        layer = FusedMoE(cfg, device="cuda")
        layer.load_weights(full)
        hidden, topk_w, topk_ids = routing(24, shape, seed=21)
        outs[a2a] = layer(hidden, TopKOutput(topk_w, topk_ids))
    assert calls == [1], "the megamoe backend must run our Triton kernel"
    assert rel_norm_err(outs["megamoe"], outs["none"]) < tolerance(fp8) / 4


if __name__ == "__main__":
    run_this_file(__file__)
