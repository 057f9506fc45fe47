"""The bf16-MMA mHC mix kernel (``mhc_mix_mma``) on the CPU: fn's three bf16 pieces sum back to
fn exactly and the partial mixes match a float64 product (Triton interpreter, in a subprocess);
both tile configs compile for sm_90, use wgmma, fit Hopper's shared memory and do not spill much
(Triton's compiler and bundled ptxas on the CPU); the kernel refuses what it cannot take.
``test_mhc_kernels.py`` runs the whole pre / fused post+pre through it under the interpreter and
``test_mhc_kernels_gpu.py`` on a GPU."""

from __future__ import annotations

import textwrap

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import run_under_interpreter
from sglang.test.run import run_this_file

register_cpu_ci(est_time=40)

SM90_SHARED_LIMIT = 232448  # Hopper's shared memory per block (227 KB)

_SCRIPT = textwrap.dedent("""
    import torch
    from sglang.kernels.ops.layernorm import mhc_mix_mma as M
    gen = torch.Generator().manual_seed(0)
    # fn over four decades, a zero column and exact bf16 values: the pieces sum back exactly.
    decades = 10.0 ** torch.randint(-3, 2, (24, 1), generator=gen)
    fn = torch.randn(24, 4 * 192, generator=gen) * decades
    fn[:, 5] = 0.0
    fn[3] = fn[3].bfloat16().float()
    w = M.split_fn_pieces(fn).double()
    lanes = M.NMIX_PAD
    pieces = sum(w[p * lanes : p * lanes + 24] for p in range(M.PIECES))
    assert torch.equal(pieces, fn.double()), (pieces - fn.double()).abs().max()
    assert not w[24:lanes].any() and not w[M.PIECES * lanes :].any()  # padding rows are zero
    for t, h, fused in [(40, 192, False), (130, 64, True), (1, 128, True)]:
        r = (torch.randn(t, 4, h, generator=gen) * 3).bfloat16()
        f = torch.randn(24, 4 * h, generator=gen) * 0.05
        if fused:
            x = torch.randn(t, h, generator=gen).bfloat16()
            post = torch.rand(t, 4, generator=gen) * 2
            comb = torch.rand(t, 4, 4, generator=gen)
            new = torch.full_like(r, float("nan"))
            part, sq = M.mix_partials_mma(r, x, post, comb, new, f)
            want = (post[:, :, None] * x[:, None].float()
                    + torch.einsum("tkj,tkh->tjh", comb, r.float()))
            # one fp32 sum rounded to bf16 (the interpreter truncates: 1 ulp)
            torch.testing.assert_close(new.float(), want, atol=1e-5, rtol=2.0 ** -7)
            mixed = new
        else:
            part, sq = M.mix_partials_mma(r, None, None, None, None, f)
            mixed = r
        flat = mixed.double().reshape(t, -1)
        exact = flat @ f.double().T
        got = part.sum(0).double()
        assert part.shape[1:] == (t, lanes) and not got[:, 24:].any()
        err = float((got[:, :24] - exact).abs().max() / exact.abs().max())
        assert err < 1e-6, (t, h, fused, err)
        sq_err = float(((sq.sum(0).double() - (flat**2).sum(1)) / (flat**2).sum(1)).abs().max())
        assert sq_err < 1e-6, sq_err
    print("MIX_MMA_OK")
    """)


def test_pieces_and_partials_under_interpreter() -> None:
    run_under_interpreter(marker="MIX_MMA_OK", code=_SCRIPT, timeout=120)


@pytest.mark.parametrize("fused", [False, True])
def test_kernel_compiles_for_sm90(fused: bool) -> None:
    pytest.importorskip("triton")
    from sglang.kernels.ops.layernorm import mhc_mix_mma as m
    from sglang.test.sm90_compile import compile_sm90, ptxas_usage

    cfg = m.FUSED_CONFIG if fused else m.PRE_CONFIG
    tile = f"tensordesc<bf16[{cfg.block_t}, {cfg.block_d}]>"
    sig = {
        "res_desc": tile, "x_desc": tile, "new_res_desc": tile, "post_ptr": "*fp32",
        "comb_ptr": "*fp32", "w_desc": f"tensordesc<bf16[{m.W_ROWS}, {cfg.block_d}]>",
        "part_ptr": "*fp32", "sq_ptr": "*fp32", "T": "i32", "H": "i32", "CHUNK": "i32",
    }  # fmt: skip
    const = {
        "FUSE_POST": fused, "NMIX_PAD": m.NMIX_PAD, "W_ROWS": m.W_ROWS,
        "BLOCK_T": cfg.block_t, "BLOCK_D": cfg.block_d, "DOT_F32": False,
    }  # fmt: skip
    kernel = compile_sm90(m._mix_mma_kernel, sig, const, cfg.num_warps, cfg.num_stages)
    usage = ptxas_usage(kernel)
    assert "wgmma" in kernel.asm["ptx"]  # Hopper tensor cores, not the mma.sync fallback
    assert usage.shared_bytes <= SM90_SHARED_LIMIT, usage
    assert usage.spill_bytes <= 64, usage  # ptxas (Triton 3.9): 0 (pre) and 16 bytes (fused)


def test_refuses_what_it_cannot_take() -> None:
    pytest.importorskip("triton")
    from sglang.kernels.ops.layernorm import mhc_mix_mma as m

    r = torch.zeros(4, 4, 128, dtype=torch.bfloat16)
    assert m.mix_mma_supports(r, fused=False) == ""
    assert "float32" in m.mix_mma_supports(r.float(), fused=False)
    odd = torch.zeros(4, 4, 80, dtype=torch.bfloat16)
    assert "H=80" in m.mix_mma_supports(odd, fused=False)
    assert "H=80" in m.mix_mma_supports(odd, fused=True)


def test_pre_and_fused_share_a_tile() -> None:
    """One tile, so one summation order: fused post+pre == post then pre, bit for bit."""
    pytest.importorskip("triton")
    from sglang.kernels.ops.layernorm import mhc_mix_mma as m

    pre, fused = m.PRE_CONFIG, m.FUSED_CONFIG
    assert (pre.block_t, pre.block_d) == (fused.block_t, fused.block_d)


if __name__ == "__main__":
    run_this_file(__file__)
