"""DeepGEMM's SM100 MegaMoE (``fp8_fp4_mega_moe``: MXFP4 experts, FP8 activations in groups of
32) through the engine's ``run_mega_routed_experts``, and the reserved-SM control on Blackwell.
Skipped (with the reason) off SM100 / SM103 or where DeepGEMM or its SM100 entry points are
missing; the Hopper kernel's test is ``test_deep_gemm_mega_moe_gpu.py``.

- MXFP4 experts laid out by ``build_mega_moe_experts_weights`` (the loader's path), one rank:
  the kernel equals the torch experts on the dequantised weights (SwiGLU with its clamp, and
  SiTU, which only the SM100 kernel has), within FP8 activation rounding;
- the call captures in a CUDA graph and replays what eager computes;
- a side-stream kernel holding 1 or 2 whole SMs for longer than the MegaMoE call
  (``sglang.test.sm_holder``): with the default reserve (2) no launch of 100 waits for it; with
  the reserve at 0 the launches that waited are counted and printed (the regression the reserve
  exists for: on Hopper most of them wait).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang.test.ci_register import register_cuda_ci
from sglang.test.real_deep_gemm import deep_gemm_or_skip
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_norm_err

register_cuda_ci(est_time=120, suite="b200-1gpu")

pytestmark = pytest.mark.gpu

HOLD_MS = 20.0
LAUNCHES = 100
E, TOP_K, H, I = 16, 4, 1024, 512


@pytest.fixture(scope="module")
def dg() -> Any:
    from sglang.srt.layers.moe.mega_moe import mega_moe_layer_reason

    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        pytest.skip(
            f"the SM100 MegaMoE needs a Blackwell GPU (sm_100/103), this is sm_{major}{minor}"
        )
    dg = deep_gemm_or_skip()
    why = mega_moe_layer_reason(dg, major * 10 + minor)
    if why is not None:
        pytest.skip(f"DeepGEMM's SM100 MegaMoE cannot run: {why}")
    return dg


def _experts(dg: Any, seed: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """MegaMoE weights from random MXFP4 experts, and the dequantised bf16 experts."""
    from sglang.srt.layers.moe.mega_moe_weights import build_mega_moe_experts_weights
    from sglang.srt.layers.quantization.mxfp4 import dequant_mxfp4, quant_mxfp4

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H**-0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=gen) * I**-0.5
    q13, s13 = quant_mxfp4(w13)
    q2, s2 = quant_mxfp4(w2)
    mega = build_mega_moe_experts_weights(dg, q13, q2, s13, s2)
    return mega, dequant_mxfp4(q13, s13), dequant_mxfp4(q2, s2)


def _batch(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, H, device="cuda", generator=gen).to(torch.bfloat16)
    scores = torch.rand(t, E, device="cuda", generator=gen)
    w, ids = scores.topk(TOP_K, dim=-1)
    return x, ids, (w / w.sum(-1, keepdim=True)).float()


def _run(
    dg: Any, mega: Any, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, params: Any
) -> torch.Tensor:
    from sglang.srt.layers.moe.mega_moe import run_mega_routed_experts

    return run_mega_routed_experts(dg, None, x, ids, w, mega[0], mega[1], params, device=x.device)


@pytest.mark.parametrize("activation,clamp", [("swiglu", 7.0), ("situ", None)])
@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_sm100_kernel_equals_the_torch_experts(
    dg: Any, activation: str, clamp: float | None, t: int
) -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts_torch
    from sglang.srt.layers.moe.mega_moe import MegaMoEParams

    mega, w13, w2 = _experts(dg, seed=1)
    x, ids, w = _batch(t, seed=t)
    params = MegaMoEParams(E, TOP_K, H, I, activation, clamp)
    with torch.no_grad():
        got = _run(dg, mega, x, ids, w, params)
        want = fused_experts_torch(
            x, w13, w2, w, ids.int(), activation=activation, swiglu_limit=clamp
        )
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    err = rel_norm_err(got, want)
    assert err < 5e-2, err  # FP8 activations in groups of 32 against bf16 ones


def test_sm100_kernel_replays_in_a_cuda_graph(dg: Any) -> None:
    from sglang.srt.layers.moe.mega_moe import MegaMoEParams

    mega, _, _ = _experts(dg, seed=2)
    params = MegaMoEParams(E, TOP_K, H, I, "swiglu", 7.0)
    x, ids, w = _batch(8, seed=3)
    with torch.no_grad():
        _run(dg, mega, x, ids, w, params)  # the buffer (a collective) and the JIT, not captured
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _run(dg, mega, x, ids, w, params)
        for seed in (4, 5):
            x2, ids2, w2 = _batch(8, seed=seed)
            x.copy_(x2)
            ids.copy_(ids2)
            w.copy_(w2)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            eager = _run(dg, mega, x2, ids2, w2, params)
            assert torch.isfinite(out).all() and rel_norm_err(out, eager) < 1e-3


def test_reserve_keeps_the_sm100_kernel_off_a_side_stream_holder(
    dg: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from sglang.srt.environ import envs
    from sglang.srt.layers.moe.mega_moe import MegaMoEParams
    from sglang.test.sm_holder import cupy_available, hold_sms

    if not cupy_available():
        pytest.skip("the SM holder needs CuPy")
    mega, _, _ = _experts(dg, seed=6)
    params = MegaMoEParams(E, TOP_K, H, I, "swiglu", 7.0)
    x, ids, w = _batch(64, seed=7)
    side = torch.cuda.Stream()
    rows = []
    with torch.no_grad():
        for reserve in (2, 0):
            with envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.override(reserve):
                _run(dg, mega, x, ids, w, params)  # JIT for this SM count, outside the timing
                torch.cuda.synchronize()
                for held in (1, 2):
                    times = []
                    for _ in range(LAUNCHES):
                        hold_sms(held, HOLD_MS, side, x.device)
                        start = torch.cuda.Event(enable_timing=True)
                        end = torch.cuda.Event(enable_timing=True)
                        start.record()
                        _run(dg, mega, x, ids, w, params)
                        end.record()
                        torch.cuda.synchronize()
                        times.append(start.elapsed_time(end))
                    times.sort()
                    stalls = sum(t > HOLD_MS / 2 for t in times)
                    rows.append((reserve, held, stalls, times[len(times) // 2], times[-1]))
    with capsys.disabled():
        print(f"\nSM100 fp8_fp4_mega_moe, side-stream holder {HOLD_MS:.0f} ms, {LAUNCHES} launches")
        print("| reserve | SMs held | launches that waited | median ms | max ms |")
        for reserve, held, stalls, med, worst in rows:
            print(f"| {reserve} | {held} | {stalls}/{LAUNCHES} | {med:.3f} | {worst:.3f} |")
    by = {(r, h): s for r, h, s, _, _ in rows}
    assert by[(2, 1)] == 0 and by[(2, 2)] == 0, rows


if __name__ == "__main__":
    run_this_file(__file__)
