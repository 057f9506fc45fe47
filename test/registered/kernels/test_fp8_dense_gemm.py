"""The block-FP8 dense GEMM (``kernels/ops/gemm``) and the fused activation quantisers
(``kernels/ops/quant/fused_quant.py``) on the CPU.

- Under Triton's interpreter (a subprocess, ``interp_`` tests): the GEMM against the torch
  dequantise-then-matmul reference on fresh random inputs, ragged M / N / K, bf16 and fp16 out,
  every tile kind (plain, transposed, split-K, 64-wide K steps); the grouped (``wo_a``) launch;
  the epilogue that writes FP8 for the next GEMM; RMSNorm + quant (also over split-K partials)
  and the gated activation + quant; the quantiser's MN-major scales.
- Compiled for sm_90 with Triton's compiler and ptxas on the CPU: every tile of the table (and
  the quantising epilogue, the split-K reduction and the fused quantisers) fits Hopper's shared
  memory under the table's own estimate, without register spills.
- The tile table, split-K sizing and input checks.

Interpreter limits (Triton 3.9) shape the tolerances: fp32 -> bf16 casts truncate (one bf16 ulp)
and an fp32 -> fp8 cast that rounds up into the next binade lands on half of it (the "slip";
``_assert_fp8_close`` allows exactly that). The GPU tests hold the compiled kernels to exact.
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import IN_INTERPRETER, interp_only, run_interp_tests
from sglang.test.run import run_this_file
from sglang.test.tolerance import ulp

register_cpu_ci(est_time=55)

SM90_SHARED_LIMIT = 232448


def _operands(m: int, n: int, k: int, seed: int, groups: int = 1):  # type: ignore[no-untyped-def]
    """Quantised A (MN-major scales, rows over five decades) and W (block scales), fresh."""
    from sglang.kernels.ops.gemm.fp8_block_gemm import quant_activation_fp8
    from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8

    gen = torch.Generator().manual_seed(seed)
    shape = (m, k) if groups == 1 else (m, groups, k)
    x = torch.randn(shape, generator=gen) * torch.logspace(-2, 2, m).view(
        m, *[1] * (len(shape) - 1)
    )
    w = torch.randn(groups * n, k, generator=gen) * 0.05
    w[: min(n, 3)] *= 40.0  # a few loud rows: their blocks get their own scales
    a_q, a_s = quant_activation_fp8(x, use_triton=False)
    if groups > 1:
        a_q, a_s = a_q.view(m, groups, -1), a_s.view(m, groups, -1)
    w_q, w_s = block_quant_weight_fp8(w)
    return a_q, a_s, w_q, w_s


def _assert_half_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within one ``dtype`` ulp (of the larger of the pair) plus 1e-5 of the largest value: the
    rounding (truncation, in the interpreter) of an fp32 sum taken in another order."""
    a, b = got.double(), want.double()
    slack = 1e-5 * float(b.abs().max())
    bad = (a - b).abs() > ulp(torch.maximum(a.abs(), b.abs()), dtype) + slack
    assert not bad.any(), f"{int(bad.sum())} entries off: {a[bad][:5]} vs {b[bad][:5]}"


def _assert_fp8_close(
    q: torch.Tensor, s: torch.Tensor, want_q: torch.Tensor, want_s: torch.Tensor, slip_ok: bool
) -> None:
    """Scales within 1e-3 (an amax may round one half-precision ulp apart); the e4m3 values, in
    the reference's scale, equal or one e4m3 step apart (a value on a rounding boundary), or, in
    the interpreter (``slip_ok``), half of the reference (its fp8 cast slip) or one subnormal
    step off; at most a few percent of them differ at all."""
    torch.testing.assert_close(s, want_s, rtol=1e-3, atol=0)
    k = q.shape[-1]
    scale = (s / want_s).repeat_interleave(128, dim=-1)[..., :k].double()
    a, b = q.double() * scale, want_q.double()
    mag = torch.maximum(a.abs(), b.abs())
    step = torch.where(
        mag >= 2.0**-6, torch.exp2(torch.floor(torch.log2(mag.clamp_min(1e-30))) - 3), 2.0**-9
    )
    ok = (a - b).abs() <= step * 1.001
    if slip_ok:
        ok |= (2 * a - b).abs() <= 1e-3 * b.abs()
    assert ok.all(), f"{int((~ok).sum())} FP8 values off: {a[~ok][:5]} vs {b[~ok][:5]}"
    assert (q.float() != want_q.float()).float().mean() < 0.12


# --------------------------------------------------------------------------------------------
# Under the interpreter (subprocess)
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the driver")
def test_kernels_under_interpreter() -> None:
    run_interp_tests(__file__, timeout=600)


def _cfg(spec: str):  # type: ignore[no-untyped-def]
    from sglang.kernels.ops.gemm.fp8_gemm_config import Fp8GemmConfig

    if spec == "table":
        return None
    bm, bn, bk, split, swap = spec.split("-")
    return Fp8GemmConfig(
        int(bm), int(bn), int(bk), num_stages=2, split_k=int(split), swap_ab=swap == "swap"
    )


@interp_only
@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "cfg"),
    [
        (1, 192, 384, torch.bfloat16, "table"),  # decode: transposed tile, split-K from the table
        (5, 130, 200, torch.float16, "16-64-128-1-swap"),  # ragged N and K
        (37, 256, 256, torch.float16, "32-64-64-2-plain"),  # 64-wide K steps, split K
        (70, 96, 384, torch.bfloat16, "64-32-128-3-plain"),  # uneven split (3 of 3, 1 short)
    ],
)
def test_interp_gemm(m: int, n: int, k: int, dtype: torch.dtype, cfg: str) -> None:
    from sglang.kernels.ops.gemm.fp8_block_gemm import fp8_block_gemm, fp8_block_gemm_torch

    a_q, a_s, w_q, w_s = _operands(m, n, k, seed=m * 31 + n)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = fp8_block_gemm(a_q, a_s, w_q, w_s, out_dtype=dtype, out=out, config=_cfg(cfg))
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    _assert_half_close(y, fp8_block_gemm_torch(a_q, a_s, w_q, w_s, torch.float32), dtype)


@interp_only
@pytest.mark.parametrize(("r", "cfg"), [(40, "16-32-128-2-plain"), (128, "16-64-128-1-swap")])
def test_interp_grouped_gemm(r: int, cfg: str) -> None:
    """Three groups; with 40 rows a group the weight's 128-row scale blocks straddle groups."""
    from sglang.kernels.ops.gemm.fp8_block_gemm import fp8_grouped_gemm, fp8_grouped_gemm_torch

    a_q, a_s, w_q, w_s = _operands(6, r, 200, seed=r, groups=3)
    y = fp8_grouped_gemm(a_q, a_s, w_q, w_s, out_dtype=torch.float16, config=_cfg(cfg))
    assert y.shape == (6, 3 * r)
    want = fp8_grouped_gemm_torch(a_q, a_s, w_q, w_s, torch.float32)
    _assert_half_close(y, want, torch.float16)


@interp_only
@pytest.mark.parametrize(("groups", "cfg"), [(1, "16-128-128-1-swap"), (2, "16-128-128-2-plain")])
def test_interp_gemm_quantising_epilogue(groups: int, cfg: str) -> None:
    """The epilogue's FP8 + scales equal quantising the fp16-rounded output (split-K: in the
    reduction)."""
    from sglang.kernels.ops.gemm.fp8_block_gemm import (
        fp8_block_gemm_torch,
        fp8_gemm_quant_out,
        fp8_grouped_gemm_torch,
    )
    from sglang.kernels.ops.quant.fp8 import per_token_group_quant_fp8

    a_q, a_s, w_q, w_s = _operands(9, 256, 256, seed=groups, groups=groups)
    q, s = fp8_gemm_quant_out(a_q, a_s, w_q, w_s, round_dtype=torch.float16, config=_cfg(cfg))
    ref = (fp8_grouped_gemm_torch if groups > 1 else fp8_block_gemm_torch)(
        a_q, a_s, w_q, w_s, torch.float16
    )
    want_q, want_s = per_token_group_quant_fp8(ref, 128, use_triton=False)
    assert q.shape == (9, groups * 256) and s.shape == (9, groups * 2) and s.stride(0) == 1
    _assert_fp8_close(q, s, want_q, want_s, slip_ok=True)


@interp_only
def test_interp_gemm_partials_add_up_to_the_gemm() -> None:
    """Split-K partials left for the consumer (the q norm's reduction) sum to the product."""
    from sglang.kernels.ops.gemm.fp8_block_gemm import fp8_block_gemm_torch, fp8_gemm_partials

    a_q, a_s, w_q, w_s = _operands(3, 128, 512, seed=8)
    parts = fp8_gemm_partials(a_q, a_s, w_q, w_s, config=_cfg("16-64-128-2-swap"))
    assert parts.shape == (2, 3, 128) and parts.dtype == torch.float32
    want = fp8_block_gemm_torch(a_q, a_s, w_q, w_s, torch.float32)
    torch.testing.assert_close(parts.sum(0), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    one = fp8_gemm_partials(a_q, a_s, w_q, w_s, config=_cfg("16-64-128-1-swap"))
    assert one.shape == (1, 3, 128)
    torch.testing.assert_close(one[0], want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@interp_only
@pytest.mark.parametrize("n", [256, 200])
def test_interp_rms_norm_quant(n: int) -> None:
    from sglang.kernels.ops.quant.fused_quant import rms_norm_quant_fp8, rms_norm_quant_fp8_torch

    gen = torch.Generator().manual_seed(n)
    w = torch.rand(n, generator=gen) + 0.5
    x = (torch.randn(6, n, generator=gen) * 3).half()
    normed = torch.full_like(x, float("nan"))
    q, s = rms_norm_quant_fp8(x, w, 1e-6, round_dtype=torch.float16, normed_out=normed)
    want_n, want_q, want_s = rms_norm_quant_fp8_torch(x, w, 1e-6, round_dtype=torch.float16)
    _assert_half_close(normed, want_n, torch.float16)
    _assert_fp8_close(q, s, want_q, want_s, slip_ok=True)
    # a split-K GEMM's fp32 partials, summed in the same launch
    parts = torch.randn(3, 5, n, generator=gen)
    q, s = rms_norm_quant_fp8(parts, w, 1e-6, round_dtype=torch.float16)
    _, want_q, want_s = rms_norm_quant_fp8_torch(parts, w, 1e-6, round_dtype=torch.float16)
    _assert_fp8_close(q, s, want_q, want_s, slip_ok=True)


@interp_only
@pytest.mark.parametrize(("activation", "limit", "n"), [("swiglu", 2.0, 1100), ("situ", None, 128)])
def test_interp_gated_act_quant(activation: str, limit: float | None, n: int) -> None:
    from sglang.kernels.ops.quant.fused_quant import gated_act_quant_fp8, gated_act_quant_fp8_torch

    gen = torch.Generator().manual_seed(n)
    gate = (torch.randn(4, n, generator=gen) * 4).half()
    up = (torch.randn(4, n, generator=gen) * 4).half()
    q, s = gated_act_quant_fp8(gate, up, activation, limit)
    want_q, want_s = gated_act_quant_fp8_torch(gate, up, activation, limit)
    assert q.shape == (4, n) and s.shape == (4, -(-n // 128))
    _assert_fp8_close(q, s, want_q, want_s, slip_ok=True)


@interp_only
def test_interp_quantiser_writes_mn_major_scales() -> None:
    from sglang.kernels.ops.quant.fp8 import per_token_group_quant_fp8

    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(3))
    q, s = per_token_group_quant_fp8(x, 128, use_triton=True, scale_mn_major=True)
    q_rows, s_rows = per_token_group_quant_fp8(x, 128, use_triton=True)
    assert s.stride() == (1, 8) and s_rows.stride() == (3, 1)  # 5 rows padded to 8
    assert torch.equal(s, s_rows) and torch.equal(q.float(), q_rows.float())


# --------------------------------------------------------------------------------------------
# Compiled for sm_90 (Triton's compiler and ptxas, on the CPU)
# --------------------------------------------------------------------------------------------

# What a launch passes divisible by 16 (pointers, K-sized and N-sized strides) and equal to 1
# (the MN-major activation scales' row stride, the weight scales' K stride), as Triton's launcher
# specialises them.
_ALIGNED = (
    "a_ptr", "as_ptr", "w_ptr", "ws_ptr", "out_ptr", "os_ptr", "N", "K", "stride_am",
    "stride_ag", "stride_asg", "stride_wn", "stride_wsn", "stride_om", "stride_ask", "stride_os",
)  # fmt: skip


def _gemm_usage(cfg, mode: int):  # type: ignore[no-untyped-def]
    from sglang.kernels.ops.gemm import fp8_block_gemm as g
    from sglang.test.sm90_compile import compile_sm90, ptxas_usage

    out = {0: "*bf16", 1: "*fp32", 2: "*fp8e4nv"}[mode]
    sig = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
           "out_ptr": out, "os_ptr": "*fp32", "eps": "fp32"}  # fmt: skip
    for name in ("M", "N", "K", "k_blocks_per_split", "stride_am", "stride_ag", "stride_asg",
                 "stride_ask", "stride_wn", "stride_wsn", "stride_os", "stride_om", "stride_osm",
                 "stride_osk"):  # fmt: skip
        sig[name] = "i32"
    const = {"stride_asm": 1, "stride_wsk": 1, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
             "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "SWAP_AB": cfg.swap_ab,
             "OUT_MODE": mode, "ROUND": 1, "SCALE_BLOCK": 128}  # fmt: skip
    kernel = compile_sm90(
        g._fp8_gemm_kernel, sig, const, cfg.num_warps, cfg.num_stages, divisible_by_16=_ALIGNED
    )
    return kernel, ptxas_usage(kernel)


def _table_cases() -> list[tuple[object, int]]:
    from sglang.kernels.ops.gemm.fp8_gemm_config import CONFIG_TABLE, FP8_SCALE_BLOCK

    cases: list[tuple[object, int]] = [(cfg, 0) for _, cfg in CONFIG_TABLE]
    last = CONFIG_TABLE[-1][1]
    assert last.block_n == FP8_SCALE_BLOCK
    cases.append((last, 2))  # the quantising epilogue on the largest tile
    return cases


@pytest.mark.parametrize("case", range(6))
def test_table_tiles_compile_for_sm90_and_fit(case: int) -> None:
    pytest.importorskip("triton")
    from sglang.kernels.ops.gemm.fp8_gemm_config import shared_bytes

    cfg, mode = _table_cases()[case]
    kernel, usage = _gemm_usage(cfg, mode)
    assert usage.shared_bytes <= shared_bytes(cfg) <= SM90_SHARED_LIMIT, (cfg, usage)
    assert usage.spill_bytes == 0, (cfg, usage)  # ptxas (Triton 3.9): 0 for every tile
    assert "wgmma" in kernel.asm["ptx"], cfg  # Hopper MMAs, every tile (transposed when short)
    assert "cp.async" in kernel.asm["ptx"], cfg  # the pipelined loads


def test_reduction_and_fused_quantisers_compile_for_sm90() -> None:
    pytest.importorskip("triton")
    from sglang.kernels.ops.gemm import fp8_block_gemm as g
    from sglang.kernels.ops.quant import fused_quant as f
    from sglang.test.sm90_compile import compile_sm90, ptxas_usage

    ints = dict.fromkeys(("n_cols", "splits", "stride_ps", "stride_pm", "stride_om",
                          "stride_osm", "stride_osk"), "i32")  # fmt: skip
    reduce = {"p_ptr": "*fp32", "out_ptr": "*fp8e4nv", "os_ptr": "*fp32", **ints, "eps": "fp32"}
    const = {"BLOCK_N": 128, "OUT_MODE": 2, "ROUND": 1}
    usages = [ptxas_usage(compile_sm90(g._splitk_reduce_kernel, reduce, const, 4, 1))]
    ints = dict.fromkeys(("n", "splits", "stride_xs", "stride_xm", "stride_nm", "stride_qm",
                          "stride_sm", "stride_sk"), "i32")  # fmt: skip
    norm = {"x_ptr": "*fp32", "w_ptr": "*fp32", "normed_ptr": "*bf16", "q_ptr": "*fp8e4nv",
            "s_ptr": "*fp32", **ints, "eps": "fp32", "quant_eps": "fp32"}  # fmt: skip
    const = {"IN_ROUND": 1, "OUT_ROUND": 1, "WRITE_NORMED": True, "BLOCK_G": 8, "GROUP_SIZE": 128}
    usages.append(ptxas_usage(compile_sm90(f._rms_norm_quant_kernel, norm, const, 4, 1)))
    ints = dict.fromkeys(("n", "stride_gm", "stride_um", "stride_qm", "stride_sm", "stride_sk"),
                         "i32")  # fmt: skip
    act = {"gate_ptr": "*bf16", "up_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
           **ints, "limit": "fp32", "quant_eps": "fp32"}  # fmt: skip
    const = {"ACTIVATION": 0, "HAS_LIMIT": True, "OUT_ROUND": 1, "BLOCK_G": 8, "GROUP_SIZE": 128}
    usages.append(ptxas_usage(compile_sm90(f._gated_act_quant_kernel, act, const, 4, 1)))
    for usage in usages:
        assert usage.spill_bytes == 0 and usage.shared_bytes <= SM90_SHARED_LIMIT, usage


# --------------------------------------------------------------------------------------------
# Tiles, split-K, references and refusals
# --------------------------------------------------------------------------------------------


def test_table_tiles_by_rows_and_split_k_fills_the_gpu() -> None:
    from sglang.kernels.ops.gemm.fp8_gemm_config import (
        MIN_K_BLOCKS_PER_SPLIT,
        choose_config,
        fit_to_shared,
        shared_bytes,
    )

    # DeepSeek V4's wq_a at decode: 16 column tiles of 64 -> K split 8 ways (32 K blocks).
    cfg = choose_config(1, 1024, 4096)
    assert (cfg.block_m, cfg.block_n, cfg.swap_ab, cfg.split_k) == (16, 64, True, 8)
    # wq_b at decode: 512 column tiles already fill 132 SMs; prefill never splits.
    assert choose_config(1, 32768, 1024).split_k == 1
    assert choose_config(8192, 1024, 4096).split_k == 1
    assert choose_config(8192, 1024, 4096).block_m == 128
    # a split keeps at least two K blocks: K = 256 allows one split only
    assert choose_config(1, 64, 256).split_k == 256 // 128 // MIN_K_BLOCKS_PER_SPLIT
    # the quantising epilogue needs 128-column tiles
    assert choose_config(1, 1024, 4096, quant_out=True).block_n == 128
    # a smaller shared memory drops pipeline stages, never launching what does not fit
    big = choose_config(8192, 4096, 4096)
    small = fit_to_shared(big, shared_bytes(big) - 1)
    assert small.num_stages == big.num_stages - 1
    with pytest.raises(ValueError, match="shared memory"):
        fit_to_shared(big, 1000)


def test_torch_reference_is_dequantise_then_matmul() -> None:
    """The references against an independent fp64 loop over scale blocks."""
    from sglang.kernels.ops.gemm.fp8_block_gemm import fp8_block_gemm_torch, fp8_grouped_gemm_torch

    a_q, a_s, w_q, w_s = _operands(3, 130, 200, seed=5)
    want = torch.zeros(3, 130, dtype=torch.float64)
    for kb in range(2):
        ks = slice(kb * 128, min(200, kb * 128 + 128))
        part = a_q[:, ks].double() @ w_q[:, ks].double().T
        w_scale = w_s[:, kb].double().repeat_interleave(128)[:130]
        want += part * a_s[:, kb].double()[:, None] * w_scale[None, :]
    got = fp8_block_gemm_torch(a_q, a_s, w_q, w_s, torch.float32)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    ga_q, ga_s, gw_q, gw_s = _operands(2, 40, 128, seed=6, groups=3)
    grouped = fp8_grouped_gemm_torch(ga_q, ga_s, gw_q, gw_s, torch.float32)
    for g in range(3):
        rows = slice(40 * g, 40 * g + 40)
        from sglang.kernels.ops.quant.fp8 import block_dequant_fp8

        w = block_dequant_fp8(gw_q, gw_s)[rows]
        a = ga_q[:, g].float() * ga_s[:, g].repeat_interleave(128, -1)
        torch.testing.assert_close(grouped[:, rows], a @ w.T, rtol=1e-5, atol=1e-5)


def test_bad_operands_are_refused() -> None:
    from sglang.kernels.ops.gemm.fp8_block_gemm import fp8_block_gemm, fp8_gemm_quant_out

    a_q, a_s, w_q, w_s = _operands(4, 192, 256, seed=7)
    with pytest.raises(ValueError, match="activation must be"):
        fp8_block_gemm(a_q.float(), a_s, w_q, w_s)
    with pytest.raises(ValueError, match="weight scales"):
        fp8_block_gemm(a_q, a_s, w_q, w_s[:1])
    with pytest.raises(ValueError, match="activation scales"):
        fp8_block_gemm(a_q, a_s[:, :1], w_q, w_s)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_block_gemm(a_q, a_s, w_q, w_s, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_gemm_quant_out(a_q, a_s, w_q, w_s)


if __name__ == "__main__":
    run_this_file(__file__)
