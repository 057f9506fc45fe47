"""Kernels chosen by fit (``sglang.kernels.fit``), on CPU with the H200's limits.

- The inventory: every kernel module of ``sglang.kernels.ops`` belongs to exactly one family (or
  is a helper several families inline), and every family's decision function and modules exist.
- The footprint formulas against the sm_90 compiler (``sglang.test.sm90_compile``, the real
  launches of the entry points, compiled and not run): each formula is an upper bound within a
  few percent of what the compiler allocates, for the fused MoE (fp32 too), the TMA grouped
  GEMMs, the sparse prefill / decode attention, the indexer scores, the absorbed MLA decode, the
  mHC split mix and the Triton MegaMoE.
- fp32 at prefill sizes: the rule's fused-MoE tiles need 262144 B of shared memory (over the
  H200's 232448) and are refitted; the launches the fitted selection makes compile within it.
  With smaller limits the selection steps down and finally refuses (the torch experts run).
- The runtime switch: a Triton build failure raised in a family's module names that family; the
  warm-up wrapper turns it off once, logs it and runs the step again; other errors propagate.
"""

from __future__ import annotations

import ast
import importlib
import logging
import pkgutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sglang.kernels.fit import decide
from sglang.kernels.fit.families import FAMILIES, INLINED_HELPERS
from sglang.kernels.fit.footprint import Footprint, fit_reason
from sglang.kernels.fit.limits import H200, DeviceLimits
from sglang.kernels.fit.switch import (
    failed_family,
    family_off_reason,
    is_build_failure,
    reset_families,
    turn_family_off,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=45)

triton = pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _families_on() -> None:
    reset_families()
    yield
    reset_families()


@pytest.fixture
def h200(monkeypatch: pytest.MonkeyPatch) -> DeviceLimits:
    """Decisions on CPU tensors see the H200's limits."""
    monkeypatch.setattr(decide, "device_limits", lambda device: H200)
    return H200


def _jit_modules() -> set[str]:
    """Modules of sglang.kernels.ops that define a ``@triton.jit`` function."""
    from sglang.kernels import ops

    found = set()
    for info in pkgutil.walk_packages(ops.__path__, ops.__name__ + "."):
        spec = importlib.util.find_spec(info.name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        tree = ast.parse(Path(spec.origin).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list
            ):
                found.add(info.name)
                break
    return found


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is not there either
        return False


def test_every_kernel_module_has_one_family_and_a_decision() -> None:
    owners: dict[str, list[str]] = {}
    for fam in FAMILIES:
        for m in fam.modules:
            owners.setdefault(m, []).append(fam.name)
    jit = _jit_modules()
    assert len(jit) >= 25, jit
    missing = sorted(m for m in jit if m not in owners and m not in INLINED_HELPERS)
    assert not missing, f"kernel modules without a family: {missing}"
    assert all(m in jit and m not in owners for m in INLINED_HELPERS), INLINED_HELPERS
    assert all(len(v) == 1 for v in owners.values()), owners
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    for fam in FAMILIES:
        present = [_exists(m) for m in fam.modules]
        if not any(present):
            continue  # a family of kernels this tree does not hold (yet)
        assert all(present), f"{fam.name}: missing modules in {fam.modules}"
        module, function = fam.decision.split(":")
        assert callable(getattr(importlib.import_module(module), function)), fam.decision


def _bound(formula: int, compiled: int | None, stages: int = 0) -> None:
    """The formula covers the compiler's number and stays close to it. With ``stages`` (a
    pipelined fp32 dot), one stage buffer of slack: Triton 3.6 keeps ``stages`` buffers of an
    fp32 warp-group dot in shared memory, newer releases one fewer, and the formula keeps the
    larger count so that it never under-counts on either."""
    assert compiled is not None
    slack = stages / (stages - 1) if stages > 1 else 1.0
    assert compiled <= formula <= compiled * slack * 1.05 + 2048, (formula, compiled)


def test_fused_moe_fp32_rule_is_over_the_h200_and_is_refitted() -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts
    from sglang.kernels.ops.moe.two_launch_config import (
        fit_two_launch_config,
        gemm_footprint,
        get_config,
        two_launch_unfit_reason,
    )
    from sglang.test.sm90_compile import sm90_dry_run

    t, h, i, e, k = 512, 256, 128, 8, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    ids = torch.randint(0, e, (t, k), generator=g, dtype=torch.int32)
    weights = torch.rand(t, k, generator=g)
    rule = get_config(8192, 256, 4096, 2048, torch.float32, top_k=6)
    assert "262144 B" in str(two_launch_unfit_reason(rule, 4, H200))
    fitted = fit_two_launch_config(rule, 4, H200)
    assert (
        fitted is not None and fitted != rule and two_launch_unfit_reason(fitted, 4, H200) is None
    )
    for cfg in (rule, fitted):
        with sm90_dry_run() as dry:
            fused_experts(x, w13, w2, weights, ids, config=cfg)
        (g1,) = dry.kernel("_moe_gemm1_kernel")
        (g2,) = dry.kernel("_moe_gemm2_kernel")
        fp1 = gemm_footprint(cfg.block_m, cfg.gemm1, 4, gate_up=True)
        fp2 = gemm_footprint(cfg.block_m, cfg.gemm2, 4, gate_up=False)
        _bound(fp1.shared_bytes, g1.shared, cfg.gemm1.num_stages)
        _bound(fp2.shared_bytes, g2.shared, cfg.gemm2.num_stages)
    assert g1.shared is not None and g1.shared <= H200.shared_optin_bytes


def test_fused_moe_selection_steps_down_then_refuses(h200: DeviceLimits) -> None:
    from sglang.kernels.ops.moe import tuned_configs as tc
    from sglang.kernels.ops.moe.fused_moe import MoEProblem, fused_moe_unfit_reason
    from sglang.kernels.ops.moe.two_launch_config import two_launch_unfit_reason

    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        for m in (1, 64, 512, 8192):
            cfg = tc.select_moe_config(m, 256, 4096, 2048, dtype, top_k=6, device=cpu, limits=h200)
            assert cfg is not None
            if isinstance(cfg, tc.FusedMoeConfig):
                assert two_launch_unfit_reason(cfg, dtype.itemsize, h200) is None
    small = replace(h200, name="small GPU", shared_optin_bytes=48 * 1024)
    cfg = tc.select_moe_config(
        8192, 256, 4096, 2048, torch.float32, top_k=6, device=cpu, limits=small
    )
    assert isinstance(cfg, tc.FusedMoeConfig) and two_launch_unfit_reason(cfg, 4, small) is None
    tiny = replace(h200, name="tiny GPU", shared_optin_bytes=1024)
    assert (
        tc.select_moe_config(64, 8, 256, 128, torch.float32, top_k=2, device=cpu, limits=tiny)
        is None
    )
    p = MoEProblem(64, 256, 128, 8, 2, False, (128, 128))
    assert fused_moe_unfit_reason(64, p, torch.float32, cpu) is None  # CPU: no limits
    turn_family_off("fused_moe", "OutOfResources: shared memory")
    assert "off after a build failure" in str(fused_moe_unfit_reason(64, p, torch.float32, cpu))


def test_families_without_a_footprint_take_their_fallback_when_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FP8 block GEMM, FP8 rows and MXFP4 experts fit themselves to the device (no footprint
    check), yet their decisions still ask the off-switch: after a build failure the torch GEMM,
    the torch row quantisers and the on-use dequantised experts run instead."""
    from sglang.kernels.ops.quant import fused_quant
    from sglang.kernels.ops.quant.fp8_rows import Fp8RowFormat
    from sglang.srt.layers import kv_cache_rows
    from sglang.srt.layers.moe.expert_weights import mxfp4_experts
    from sglang.srt.layers.moe.moe_runner.base import MoERunConfig
    from sglang.srt.layers.moe.moe_runner.triton_runner import TritonMoERunner
    from sglang.srt.layers.quantization.fp8_linear import gemm_backend
    from sglang.test.mxfp4_experts import random_mxfp4_experts

    cuda = torch.device("cuda")  # the decision only: nothing is allocated there
    assert gemm_backend(512, 512, torch.bfloat16, cuda)[0] == "triton"  # DeepGEMM absent here
    runner = TritonMoERunner(MoERunConfig())
    packed = mxfp4_experts(*random_mxfp4_experts(2, 64, 32, seed=3))
    assert runner.unreadable_reason(packed) is None
    for family in ("fp8_block_gemm", "fp8_rows", "fused_moe_mxfp4"):
        turn_family_off(family, "CompilationError: at 1:2")
    backend, why = gemm_backend(512, 512, torch.bfloat16, cuda)
    assert backend == "torch" and "fp8_block_gemm kernels are off" in why
    assert "fused_moe_mxfp4 kernels are off" in str(runner.unreadable_reason(packed))
    # The row writers: "Triton could run" here, yet the torch path runs (the Triton one would
    # fail on CPU tensors), and its rows equal the format's own quantiser's.
    monkeypatch.setattr(fused_quant, "triton_can_run", lambda t: True)
    monkeypatch.setattr(kv_cache_rows, "triton_can_run", lambda t: True)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=g)
    q, s = fused_quant.rms_norm_quant_fp8(x, torch.rand(256, generator=g) + 0.5, 1e-6)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 256) and torch.isfinite(s).all()
    fmt = Fp8RowFormat(128, 64)
    codec = kv_cache_rows.Fp8Rows(fmt, torch.bfloat16)
    store = torch.zeros(2, 4, fmt.row_bytes, dtype=torch.uint8)  # blocks of rows
    values = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    codec.write(store, torch.tensor([1, 6, 3]), values)
    flat = store.view(-1, fmt.row_bytes)
    assert torch.equal(flat[[1, 6, 3]], codec.encode(values))
    assert not flat[[0, 2, 4, 5, 7]].any()


def test_tma_footprint_matches_the_compiler_and_needs_hopper() -> None:
    from sglang.kernels.ops.moe.fused_moe import fused_experts
    from sglang.kernels.ops.moe.grouped_gemm_tma import tma_footprints, tma_unfit_reason
    from sglang.kernels.ops.moe.tuned_configs import DEFAULT_TMA_CONFIGS
    from sglang.test.sm90_compile import sm90_dry_run

    cfg = DEFAULT_TMA_CONFIGS["bf16"]
    t, h, i, e, k = 256, 512, 256, 8, 2
    g = torch.Generator().manual_seed(1)
    bf = torch.bfloat16
    with sm90_dry_run() as dry:
        fused_experts(
            torch.randn(t, h, generator=g).to(bf),
            torch.randn(e, 2 * i, h, generator=g).to(bf),
            torch.randn(e, h, i, generator=g).to(bf),
            torch.rand(t, k, generator=g),
            torch.randint(0, e, (t, k), generator=g, dtype=torch.int32),
            config=cfg,
        )
    up, down = tma_footprints(cfg, fp8=False)
    _bound(up.shared_bytes, dry.kernel("_gate_up_tma_kernel")[0].shared)
    _bound(down.shared_bytes, dry.kernel("_down_tma_kernel")[0].shared)
    assert tma_unfit_reason(cfg, 4096, 2048, False, 128, H200) is None
    ampere = replace(H200, name="A100", capability=(8, 0))
    assert "Hopper" in str(tma_unfit_reason(cfg, 4096, 2048, False, 128, ampere))
    half = replace(H200, shared_optin_bytes=100 * 1024)
    assert "shared memory" in str(tma_unfit_reason(cfg, 4096, 2048, False, 128, half))


def test_attention_footprints_match_the_compiler() -> None:
    from sglang.kernels.ops.attention import absorbed_mla_decode as mla
    from sglang.kernels.ops.attention import indexer_scores as idx
    from sglang.kernels.ops.attention import sparse_decode_attention as dec
    from sglang.kernels.ops.attention import sparse_prefill_attention as pre
    from sglang.test.sm90_compile import sm90_dry_run

    bf = torch.bfloat16
    d, heads, bs = 512, 64, 2
    with sm90_dry_run() as dry:
        ring = torch.randn(3, 128, d, dtype=bf)
        dec.sparse_decode_attention(
            torch.randn(bs, heads, d, dtype=bf), ring, torch.tensor([0, 1]),
            torch.tensor([10, 20]), torch.zeros(heads), 0.1,
            entries=torch.randn(3, 64, d, dtype=bf), ratio=4,
            picks=torch.zeros(bs, 16, dtype=torch.int64),
        )  # fmt: skip
        for q_dtype in (bf, torch.float32):
            pre.sparse_prefill_attention(
                torch.randn(8, heads, d, dtype=q_dtype), 0, torch.randn(8, d, dtype=bf), 0,
                torch.zeros(heads), scale=0.1, window=128,
            )  # fmt: skip
        idx.indexer_scores(
            torch.randn(bs, heads, 128, dtype=bf), torch.randn(bs, heads),
            torch.randn(3, 64, 128, dtype=bf), torch.tensor([0, 1]), torch.tensor([10, 20]), 0.1,
        )  # fmt: skip
        store = torch.randn(4, 256, 576, dtype=bf)
        table, lengths = torch.arange(4).view(bs, 2), torch.tensor([300, 10])
        for q_dtype in (torch.float32, bf):
            q_lat = torch.randn(bs, heads, 512, dtype=q_dtype)
            q_pe = torch.randn(bs, heads, 64, dtype=q_dtype)
            mla.absorbed_mla_decode(q_lat, q_pe, store, table, lengths, 0.1)
    _bound(
        dec.decode_footprint(d).shared_bytes,
        dry.kernel("sparse_decode_attention._split_kernel")[0].shared,
    )
    prefill = dry.kernel("sparse_prefill_attention._prefill_kernel")
    _bound(pre.prefill_footprint(d, 1).shared_bytes, prefill[0].shared)
    _bound(pre.prefill_footprint(d, 3).shared_bytes, prefill[1].shared)
    _bound(idx.scores_footprint(heads, 128).shared_bytes, dry.kernel("_scores_kernel")[0].shared)
    split = dry.kernel("absorbed_mla_decode._split_kernel")
    _bound(mla.absorbed_decode_footprint(512, 64, 3).shared_bytes, split[0].shared)
    _bound(mla.absorbed_decode_footprint(512, 64, 1).shared_bytes, split[1].shared)
    assert mla.absorbed_decode_unfit_reason(512, 64, bf, H200) is None
    assert "bf16 or fp16" in str(mla.absorbed_decode_unfit_reason(512, 64, torch.float32, H200))
    assert dec.sparse_decode_unfit_reason(512, H200) is None
    assert "shared memory" in str(dec.sparse_decode_unfit_reason(4096, H200))


def test_mhc_and_mega_moe_footprints_match_the_compiler() -> None:
    from sglang.kernels.ops.layernorm import mhc_triton
    from sglang.kernels.ops.layernorm.mhc_params import MhcParams
    from sglang.kernels.ops.moe import mega_moe_triton as mega
    from sglang.test.sm90_compile import sm90_dry_run

    t, hc, h, e, k = 300, 4, 256, 8, 2
    with sm90_dry_run() as dry:
        for dtype in (torch.float32, torch.float16):
            res = torch.randn(t, hc, h, dtype=dtype)
            mhc_triton.mhc_pre_triton(
                res, torch.randn(24, hc * h), torch.rand(3), torch.rand(24),
                torch.empty(t, h, dtype=dtype),
                MhcParams(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=2),
            )  # fmt: skip
        cfg = mega.MegaMoEConfig(16, 64, 128, 128, 4, 3, 2)
        mega.mega_fused_experts(
            torch.randn(4, 512, dtype=torch.bfloat16),
            torch.randn(e, 512, 512, dtype=torch.bfloat16),
            torch.randn(e, 512, 256, dtype=torch.bfloat16),
            torch.rand(4, k), torch.randint(0, e, (4, k), dtype=torch.int32),
            num_sms=132, config=cfg,
        )  # fmt: skip
    partial = dry.kernel("_mix_partial_kernel")
    for rec, elem in zip(partial, (4, 2), strict=True):
        bt, bd = rec.constexprs["BLOCK_T"], rec.constexprs["BLOCK_D"]
        fp = mhc_triton.partial_footprint(bt, bd, rec.num_warps, elem, hc, fused=False)
        _bound(fp.shared_bytes, rec.shared)
    fp = mega.mega_footprint(cfg, fp8=False)
    _bound(fp.shared_bytes, dry.kernel("_mega_moe_kernel")[0].shared)
    assert fp.ctas_per_sm == 2 and mega.mega_unfit_reason(cfg, False, H200) is None
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert mhc_triton.mhc_triton_unfit_reason(dtype, 4, H200) is None


def test_fit_reason_names_the_numbers() -> None:
    assert fit_reason("k", Footprint(232448, 8), H200) is None
    why = str(fit_reason("k", Footprint(262144, 8), H200))
    assert "262144" in why and "232448" in why and "NVIDIA H200" in why
    assert "threads" in str(fit_reason("k", Footprint(0, 64), H200))
    assert "registers" in str(fit_reason("k", Footprint(0, 32, registers=255), H200))
    assert "an SM" in str(fit_reason("k", Footprint(120000, 4, ctas_per_sm=2), H200))
    assert fit_reason("k", Footprint(10**9, 64), None) is None  # CPU / interpreter: no limits


def _raise_from(module: str, exc: BaseException) -> None:
    """Raise ``exc`` from a frame that belongs to ``module`` (as a launch there would)."""
    code = compile("def launch(exc):\n    raise exc\n", f"<{module}>", "exec")
    namespace = {"__name__": module}
    exec(code, namespace)  # noqa: S102 - a fixed two-line function, to own a module's frame
    namespace["launch"](exc)


def test_a_build_failure_names_its_family() -> None:
    from triton.runtime.errors import OutOfResources

    def oor() -> OutOfResources:
        return OutOfResources(262144, 232448, "shared memory")

    with pytest.raises(OutOfResources) as info:
        _raise_from("sglang.kernels.ops.moe.fused_moe", oor())
    assert is_build_failure(info.value)
    assert failed_family(info.value).name == "fused_moe"  # type: ignore[union-attr]
    with pytest.raises(OutOfResources) as info:
        _raise_from("sglang.srt.layers.mhc", oor())  # no family's module on the stack
    assert failed_family(info.value) is None
    with pytest.raises(ValueError) as plain:
        _raise_from("sglang.kernels.ops.moe.fused_moe", ValueError("a bad shape"))
    assert not is_build_failure(plain.value) and failed_family(plain.value) is None


def test_warmup_turns_a_failing_family_off_once(caplog: pytest.LogCaptureFixture) -> None:
    from triton.runtime.errors import OutOfResources

    from sglang.srt.model_executor.kernel_fallback import run_with_kernel_fallback

    calls: list[str] = []

    def step() -> str:
        if family_off_reason("absorbed_mla_decode") is None:  # as a decision function does
            calls.append("kernel")
            _raise_from(
                "sglang.kernels.ops.attention.absorbed_mla_decode",
                OutOfResources(300000, 232448, "shared memory"),
            )
        calls.append("fallback")
        return "served"

    with caplog.at_level(logging.WARNING):
        assert run_with_kernel_fallback(step, "warm-up") == "served"
    assert calls == ["kernel", "fallback"]
    assert "out of resource" in str(family_off_reason("absorbed_mla_decode")).lower()
    assert "absorbed_mla_decode kernels failed to build" in caplog.text
    assert "the torch absorbed decode runs instead" in caplog.text

    def ignores_the_switch() -> None:  # a decision function that does not ask: raised, not hidden
        _raise_from("sglang.kernels.ops.kda.chunk_prefill", OutOfResources(1, 0, "shared memory"))

    with pytest.raises(OutOfResources):
        run_with_kernel_fallback(ignores_the_switch, "warm-up")
    assert family_off_reason("kda") is not None
    with pytest.raises(KeyError):
        run_with_kernel_fallback(lambda: {}["x"], "warm-up")


if __name__ == "__main__":
    run_this_file(__file__)
