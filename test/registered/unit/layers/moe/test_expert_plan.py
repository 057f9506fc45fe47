"""The MoE expert table (``layers/moe/expert_plan.py``) for every ``--moe-runner-backend`` x
``--moe-a2a-backend`` x expert format x device (an H200's, a B200's and a CPU's facts): each
combination either has a plan or is refused with a message naming the flag, and the answers are
the ones written out below. The combinations a CPU can run are then run: a tiny layer loaded as
planned and compared with the dequantised reference."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from sglang.kernels.ops.moe.fused_moe import fused_experts_torch
from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8
from sglang.srt.layers.moe.expert_plan import (
    B200,
    CPU,
    H200,
    Conversion,
    DeviceFacts,
    ExpertPlan,
    ExpertPlanError,
    ExpertShape,
    flags_refusal,
    plan_experts,
)
from sglang.srt.layers.moe.expert_weights import ExpertLayout, WeightFormat
from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.layers.quantization.mxfp4 import dequant_mxfp4, quant_mxfp4
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex
from sglang.srt.model_loader.expert_loading import load_layer_experts
from sglang.srt.model_loader.weight_source import as_weight_source
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=12)

RUNNERS = ("auto", "torch", "triton", "deep_gemm")
A2AS = ("none", "ep", "megamoe")
FORMATS = tuple(WeightFormat)
DEVICES = {"H200": H200, "B200": B200, "CPU": CPU}
DSV4 = ExpertShape(256, 4096, 2048, 2048, 6, "swiglu", 10.0)
K3 = ExpertShape(384, 3584, 3072, 3072, 16, "situ", None)

# device, runner, a2a, format -> "refused: <needle>" or "<resident>[ mega][ converted]" (bf16
# model dtype, DeepSeek V4's expert shapes). "*" matches every runner / a2a.
EXPECTED_TEXT = """
H200 * * bf16 bf16
H200 * none fp8 fp8
H200 * ep fp8 fp8
H200 * megamoe fp8 fp8 mega
H200 auto none mxfp4 mxfp4
H200 auto ep mxfp4 mxfp4
H200 torch none mxfp4 mxfp4
H200 torch ep mxfp4 mxfp4
H200 triton none mxfp4 mxfp4
H200 triton ep mxfp4 mxfp4
H200 deep_gemm none mxfp4 fp8 converted
H200 deep_gemm ep mxfp4 fp8 converted
H200 * megamoe mxfp4 fp8 mega converted
B200 * * bf16 bf16
B200 * * fp8 fp8
B200 auto none mxfp4 mxfp4
B200 auto ep mxfp4 mxfp4
B200 torch none mxfp4 mxfp4
B200 torch ep mxfp4 mxfp4
B200 triton none mxfp4 mxfp4
B200 triton ep mxfp4 mxfp4
B200 deep_gemm none mxfp4 fp8 converted
B200 deep_gemm ep mxfp4 fp8 converted
B200 * megamoe mxfp4 mxfp4 mega
CPU triton * * refused: --moe-runner-backend triton needs a CUDA device
CPU deep_gemm * * refused: --moe-runner-backend deep_gemm needs a CUDA device
CPU auto * bf16 bf16
CPU torch * bf16 bf16
CPU auto * fp8 fp8
CPU torch * fp8 fp8
CPU auto * mxfp4 mxfp4
CPU torch * mxfp4 mxfp4
"""


def _expected() -> dict[tuple[str, str, str, str], str]:
    table: dict[tuple[str, str, str, str], str] = {}
    for line in EXPECTED_TEXT.strip().splitlines():
        device, runner, a2a, fmt, *answer = line.split()
        for r, a, f in itertools.product(
            RUNNERS if runner == "*" else (runner,),
            A2AS if a2a == "*" else (a2a,),
            [x.value for x in FORMATS] if fmt == "*" else (fmt,),
        ):
            key = (device, r, a, f)
            assert key not in table, f"the table answers {key} twice"
            table[key] = " ".join(answer)
    return table


EXPECTED = _expected()


def _answer(plan: ExpertPlan) -> str:
    parts = [plan.resident.value]
    if plan.layout is ExpertLayout.MEGA:
        parts.append("mega")
    if plan.conversion is Conversion.MXFP4_TO_FP8:
        parts.append("converted")
    return " ".join(parts)


def _plan(
    device: DeviceFacts,
    runner: str,
    a2a: str,
    fmt: WeightFormat,
    shape: ExpertShape = DSV4,
    dtype: torch.dtype = torch.bfloat16,
) -> str:
    try:
        plan = plan_experts(runner=runner, a2a=a2a, fmt=fmt, dtype=dtype, facts=device, shape=shape)
    except ExpertPlanError as exc:
        return f"refused: {exc}"
    return _answer(plan)


def test_the_table_answers_every_combination_once() -> None:
    assert len(EXPECTED) == len(DEVICES) * len(RUNNERS) * len(A2AS) * len(FORMATS)


@pytest.mark.parametrize("device", list(DEVICES))
def test_every_combination_has_its_written_answer(device: str) -> None:
    wrong = []
    for runner, a2a, fmt in itertools.product(RUNNERS, A2AS, FORMATS):
        got = _plan(DEVICES[device], runner, a2a, fmt)
        want = EXPECTED[(device, runner, a2a, fmt.value)]
        ok = got.startswith(want) if want.startswith("refused") else got == want
        if not ok:
            wrong.append(f"{device} {runner} {a2a} {fmt.value}: got {got!r}, want {want!r}")
    assert not wrong, "\n".join(wrong)


def test_refusals_name_the_flag_and_the_flag_rows_are_the_servers() -> None:
    for device, runner, a2a, fmt in itertools.product(DEVICES, RUNNERS, A2AS, FORMATS):
        got = _plan(DEVICES[device], runner, a2a, fmt)
        if got.startswith("refused"):
            assert "--moe-runner-backend" in got or "--dtype" in got, got
            # format-independent refusals are the ones ServerArgs asks before the load
            flags = flags_refusal(runner, a2a, torch.bfloat16, DEVICES[device])
            assert flags is not None and flags in got
    no_dg = DeviceFacts("H100 without DeepGEMM", "cuda", 90, deep_gemm=False)
    why = flags_refusal("deep_gemm", "none", torch.bfloat16, no_dg)
    assert why is not None and "needs a usable DeepGEMM" in why
    why = flags_refusal("deep_gemm", "none", torch.float32, H200)
    assert why is not None and "--dtype float32" in why
    assert flags_refusal("auto", "megamoe", torch.float32, CPU) is None


def test_exactness_mode_dequantises_unless_blackwells_kernel_keeps_the_copy() -> None:
    fp32 = torch.float32
    assert _plan(H200, "triton", "none", WeightFormat.MXFP4, dtype=fp32) == "bf16"
    assert _plan(CPU, "torch", "none", WeightFormat.MXFP4, dtype=fp32) == "bf16"
    # Hopper's MegaMoE pre-dispatch takes bf16 activations: fp32 dequantises instead
    assert _plan(H200, "auto", "megamoe", WeightFormat.MXFP4, dtype=fp32) == "bf16"
    assert _plan(B200, "auto", "megamoe", WeightFormat.MXFP4, dtype=fp32) == "mxfp4 mega"
    plan = plan_experts(
        runner="torch", a2a="none", fmt=WeightFormat.MXFP4, dtype=fp32, facts=CPU, shape=DSV4
    )
    assert plan.conversion is Conversion.DEQUANTISE and "float32, dequantised at load" in (
        plan.describe()
    )
    assert _plan(H200, "deep_gemm", "none", WeightFormat.MXFP4, dtype=fp32).startswith(
        "refused: --moe-runner-backend deep_gemm runs bf16/FP8 experts, not --dtype float32"
    )


def test_kimi_k3_situ_keeps_mxfp4_on_hopper_and_the_mega_copy_on_blackwell() -> None:
    hopper = plan_experts(
        runner="auto", a2a="megamoe", fmt=WeightFormat.MXFP4, dtype=torch.bfloat16, facts=H200,
        shape=K3,
    )  # fmt: skip
    assert _answer(hopper) == "mxfp4" and hopper.mega_kernel is None
    assert hopper.mega_reason is not None and "SwiGLU only" in hopper.mega_reason
    assert "fused_experts_mxfp4" in hopper.runner_path
    blackwell = plan_experts(
        runner="auto", a2a="megamoe", fmt=WeightFormat.MXFP4, dtype=torch.bfloat16, facts=B200,
        shape=K3,
    )  # fmt: skip
    assert _answer(blackwell) == "mxfp4 mega" and blackwell.mega_kernel == "fp8_fp4_mega_moe"


def test_shapes_off_the_fp8_grid() -> None:
    narrow = ExpertShape(256, 4096, 2048, 64, 6, "swiglu", 10.0)  # TP 32: 64 rows a rank
    got = _plan(H200, "deep_gemm", "none", WeightFormat.MXFP4, shape=narrow)
    assert got.startswith("refused: --moe-runner-backend deep_gemm takes MXFP4 experts converted")
    assert "--tp-size" in got
    assert _plan(H200, "triton", "none", WeightFormat.MXFP4, shape=narrow) == "mxfp4"
    wide = ExpertShape(256, 4096, 4224, 4224, 6, "swiglu", 10.0)  # past Hopper's kernel
    plan = plan_experts(
        runner="auto", a2a="megamoe", fmt=WeightFormat.MXFP4, dtype=torch.bfloat16, facts=H200,
        shape=wide,
    )  # fmt: skip
    assert _answer(plan) == "mxfp4" and "intermediate <= 4096" in (plan.mega_reason or "")


def test_triton_runner_reads_mxfp4_in_both_layouts_with_the_w4a16_kernel() -> None:
    for a2a, facts in (("none", H200), ("megamoe", B200)):
        plan = plan_experts(
            runner="triton", a2a=a2a, fmt=WeightFormat.MXFP4, dtype=torch.bfloat16,
            facts=facts, shape=DSV4,
        )  # fmt: skip
        assert plan.resident is WeightFormat.MXFP4, (a2a, plan)
        assert "fused_experts_mxfp4" in plan.runner_path, (a2a, plan.runner_path)


# --- the combinations a CPU runs, run ------------------------------------------------------------

E, H, I, K = 4, 128, 128, 2


@functools.cache
def _checkpoint(fmt: WeightFormat) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per-expert tensors under ``layers.0.experts`` and the dequantised ``w13``, ``w2``."""
    gen = torch.Generator().manual_seed(4)
    ckpt: dict[str, torch.Tensor] = {}
    w13, w2 = [], []
    for e in range(E):
        parts = {}
        for w, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            t = torch.randn(*shape, generator=gen) * 0.1
            name = f"layers.0.experts.{e}.{w}"
            if fmt is WeightFormat.MXFP4:
                q, s = quant_mxfp4(t)
                ckpt[name + ".weight"], ckpt[name + ".scale"] = q, s
                t = dequant_mxfp4(q, s, torch.float32)
            elif fmt is WeightFormat.FP8:
                q, s = block_quant_weight_fp8(t, (128, 128))
                ckpt[name + ".weight"], ckpt[name + ".scale"] = q, s
                t = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
            else:
                t = t.bfloat16()
                ckpt[name + ".weight"] = t
                t = t.float()
            parts[w] = t
        w13.append(torch.cat([parts["w1"], parts["w3"]]))
        w2.append(parts["w2"])
    return ckpt, torch.stack(w13), torch.stack(w2)


@pytest.mark.parametrize(
    ("runner", "a2a", "fmt"),
    [
        (r, a, f)
        for r, a, f in itertools.product(RUNNERS, A2AS, FORMATS)
        if not EXPECTED[("CPU", r, a, f.value)].startswith("refused")
    ],
)
def test_cpu_combinations_load_as_planned_and_match_the_reference(
    runner: str, a2a: str, fmt: WeightFormat
) -> None:
    ckpt, w13, w2 = _checkpoint(fmt)
    index, _ = CheckpointIndex.build(as_weight_source(ckpt), lambda n: n)
    layer = FusedMoE(FusedMoEConfig(E, H, I, K, runner=runner, a2a_backend=a2a))
    load = load_layer_experts(
        index,
        layer,
        "layers.0.experts",
        layer_id=0,
        scale_suffixes=lambda f: (".scale",),
        dtype=torch.bfloat16,
        mega_weight_builder=None,
        facts=CPU,
    )
    assert _answer(load.plan) == EXPECTED[("CPU", runner, a2a, fmt.value)]
    assert layer.weights is not None and layer.weights.fmt is load.plan.resident
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(6)]).int()
    weights = torch.rand(6, K, generator=gen)
    with torch.no_grad():
        got = layer(x, TopKOutput(weights, ids))
    if fmt is WeightFormat.FP8:  # the W8A8 runner quantises activations: its own oracle
        w = layer.weights
        want = fused_experts_torch(
            x, w.w13, w.w2, weights, ids, w13_scale=w.w13_scale, w2_scale=w.w2_scale,
            block_shape=(128, 128),
        )  # fmt: skip
        assert torch.equal(got, want)
    else:  # MXFP4 on use, and bf16: exactly the dequantised weights in bf16
        want = fused_experts_torch(x, w13.bfloat16(), w2.bfloat16(), weights, ids)
        assert torch.equal(got, want)


if __name__ == "__main__":
    run_this_file(__file__)
