"""CPU checks of the Triton MegaMoE kernel under Triton's interpreter (in a subprocess, as in
test_fused_moe.py), plus its host-side contracts.

The interpreter runs the grid's CTAs one after another, which is the harshest residency there
is: the first CTA must take every tile in queue order and finish the launch alone. It also
shows the bounded wait: a whole-grid barrier can never complete there, and it must report.
Interpreter limits (see test_fused_moe.py): fp32 activations for the exact checks; FP8
runs with in-kernel activation quantisation, whose fp8 cast slips in the interpreter, so FP8 is
checked loosely here and exactly on the GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import IN_INTERPRETER, interp_only, run_interp_tests
from sglang.test.moe_cases import ACTS, make_moe
from sglang.test.run import run_this_file
from sglang.test.tolerance import rel_norm_err

if TYPE_CHECKING:
    from sglang.kernels.ops.moe.mega_moe_triton import MegaMoEConfig

register_cpu_ci(est_time=90)


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the driver")
def test_mega_kernel_under_interpreter() -> None:
    run_interp_tests(str(Path(__file__).resolve()), timeout=600)


def _tiny_config() -> MegaMoEConfig:
    from sglang.kernels.ops.moe.mega_moe_triton import MegaMoEConfig

    return MegaMoEConfig(
        block_m=16, block_n1=16, block_n2=32, block_k=32, num_warps=4, num_stages=2
    )


@interp_only
@pytest.mark.parametrize("activation,limit", ACTS)
@pytest.mark.parametrize(
    "shape,grid",
    [
        ((1, 4, 2, 64, 32), 1),
        ((9, 6, 3, 64, 64), 3),
        ((13, 5, 4, 96, 32), 7),
        ((40, 8, 2, 64, 32), 2),
    ],
)
def test_interp_mega_fp32(
    activation: str, limit: float | None, shape: tuple[int, ...], grid: int
) -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts_torch
    from sglang.kernels.ops.moe.mega_moe_triton import MegaMoELaunch, mega_fused_experts

    tokens, experts, k, hidden, inter = shape
    moe = make_moe(tokens, experts, k, hidden, inter, torch.float32, fp8=False, seed=tokens)
    # A token with no expert must come out as zeros. Only with more than two tokens: masking the
    # only token of a tiny case would leave nothing for the rel_err check below to compare.
    masked = tokens > 2
    if masked:
        moe["topk_ids"][tokens // 2] = -1
    want = fused_experts_torch(**moe, activation=activation, swiglu_limit=limit)
    for _ in range(2):  # the second launch reuses the workspace the first one re-armed
        out = torch.full_like(want, float("nan"))
        info: list[MegaMoELaunch] = []
        got = mega_fused_experts(
            **moe,
            activation=activation,
            swiglu_limit=limit,
            num_sms=grid,
            out=out,
            config=_tiny_config(),
            launch_info=info,
        )
        info[-1].check()
        assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
        if masked:
            assert (out[tokens // 2] == 0).all()
        assert rel_norm_err(out, want) < 1e-5
        assert int(info[-1].workspace.counters.abs().sum()) == 0, "every counter must be re-armed"


@interp_only
@pytest.mark.parametrize("activation,limit", ACTS)
def test_interp_mega_fp8(activation: str, limit: float | None) -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts_torch
    from sglang.kernels.ops.moe.mega_moe_triton import MegaMoEConfig, mega_fused_experts

    moe = make_moe(6, 4, 2, 256, 128, torch.float32, fp8=True, seed=3)
    want = fused_experts_torch(**moe, activation=activation, swiglu_limit=limit)
    out = torch.full_like(want, float("nan"))
    cfg = MegaMoEConfig(16, 32, 64, 128, 4, 2)
    mega_fused_experts(
        **moe, activation=activation, swiglu_limit=limit, num_sms=3, out=out, config=cfg
    )
    assert torch.isfinite(out).all()
    # Loose: the interpreter's fp8 cast halves some values (module docstring); the GPU test is
    # exact.
    assert rel_norm_err(out, want) < 0.2


@interp_only
def test_interp_whole_grid_barrier_reports() -> None:
    from sglang.kernels.ops.moe.mega_moe_triton import MegaMoEWaitTimeout, mega_fused_experts

    moe = make_moe(5, 4, 2, 64, 32, torch.float32, fp8=False, seed=9)
    with pytest.raises(
        MegaMoEWaitTimeout, match=r"grid of 2 CTAs.*SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS"
    ):
        got = mega_fused_experts(
            **moe,
            num_sms=2,
            config=_tiny_config(),
            whole_grid_sync=True,
            timeout_ms=20.0,
            launch_info=(info := []),
        )
        info[-1].check()
    # The error cleared the workspace: a normal launch is right again.
    from sglang.kernels.ops.moe.fused_moe import fused_experts_torch

    got = mega_fused_experts(**moe, num_sms=2, config=_tiny_config(), launch_info=info)
    info[-1].check()
    assert rel_norm_err(got, fused_experts_torch(**moe)) < 1e-5


@interp_only
def test_interp_default_tiles_fit_small_widths() -> None:
    # The built-in model's widths (hidden 128, intermediate 64) with get_mega_config's tiles:
    # fit_config shrinks them instead of refusing.
    from sglang.kernels.ops.moe.fused_moe import fused_experts_torch
    from sglang.kernels.ops.moe.mega_moe_triton import (
        fit_config,
        get_mega_config,
        mega_fused_experts,
    )

    cfg = fit_config(get_mega_config(5, 8, 2, False), 128, 64, False)
    assert (cfg.block_k, cfg.block_n1, cfg.block_n2) == (64, 64, 128)
    moe = make_moe(5, 8, 2, 128, 64, torch.float32, fp8=False, seed=4)
    got = mega_fused_experts(**moe, activation="swiglu", swiglu_limit=7.0, num_sms=2)
    assert (
        rel_norm_err(got, fused_experts_torch(**moe, activation="swiglu", swiglu_limit=7.0)) < 1e-5
    )


def test_unsupported_shapes_are_named() -> None:
    from sglang.kernels.ops.moe.mega_moe_triton import MegaMoEConfig, unsupported_reason

    cfg = MegaMoEConfig(16, 32, 64, 128, 4, 4)
    assert unsupported_reason(4096, 2048, False, (128, 128), cfg) is None
    assert "intermediate size 100" in (unsupported_reason(4096, 100, False, (128, 128), cfg) or "")
    assert "hidden size 4000" in (unsupported_reason(4000, 2048, False, (128, 128), cfg) or "")
    assert "128x128" in (unsupported_reason(4096, 2048, True, (64, 64), cfg) or "")
    assert "block_n1 dividing 128" in (
        unsupported_reason(4096, 2304, True, (128, 128), MegaMoEConfig(16, 96, 64, 128, 4, 4)) or ""
    )
    fp8_cfg = MegaMoEConfig(16, 32, 128, 128, 4, 4, 3)
    assert unsupported_reason(4096, 2048, True, (128, 128), fp8_cfg) is None


def test_config_by_rows_per_expert() -> None:
    from sglang.kernels.ops.moe.mega_moe_triton import get_mega_config

    assert get_mega_config(1, 256, 6, False).block_m == 16
    assert get_mega_config(512, 256, 6, True).block_m == 16  # 12 rows an expert: still decode-like
    assert get_mega_config(512, 384, 16, False).block_m == 32
    assert get_mega_config(8192, 256, 6, False).block_m == 64


def test_backend_choice_names_why_each_kernel_is_unusable(caplog: pytest.LogCaptureFixture) -> None:
    from sglang.srt.layers.moe.a2a.mega_moe_a2a import try_run_mega_routed
    from sglang.srt.layers.moe.expert_weights import ExpertWeights
    from sglang.srt.layers.moe.mega_moe import MegaMoEParams
    from sglang.srt.layers.moe.mega_moe_triton_backend import triton_mega_unavailable_reason
    from sglang.srt.utils import log as log_utils

    moe = make_moe(3, 4, 2, 128, 128, torch.bfloat16, fp8=False)
    w = ExpertWeights(moe["w13"], moe["w2"])
    x = moe["hidden"]
    assert "CUDA" in (triton_mega_unavailable_reason(x.device, w, 1, 2) or "")
    assert "no expert weights" in (triton_mega_unavailable_reason(x.device, None, 1, 2) or "")

    class TwoRanks:
        world_size = 2

    log_utils._said.clear()  # log_once: say it again for this test
    with caplog.at_level("WARNING"):
        got = try_run_mega_routed(
            None,
            TwoRanks(),
            x,
            moe["topk_ids"],
            moe["topk_weights"],
            None,
            MegaMoEParams(4, 2, 128, 128),
            local_weights=w,
        )
    assert got is None
    text = caplog.text
    assert "MegaMoE weights were not built" in text and "needs a CUDA device" in text


if __name__ == "__main__":
    run_this_file(__file__)
