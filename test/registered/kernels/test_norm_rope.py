"""The fused norm + RoPE + cast kernel and the one-launch RoPE cos/sin, under the Triton
interpreter (in a subprocess: ``triton.jit`` reads TRITON_INTERPRET when a kernel module is
imported), against the torch ops they replace, on fresh random inputs:

- ``norm_rope`` for every norm (none, unweighted, weighted) x forward / inverse rope x no rope,
  heads of several widths (rope part odd-aligned, non-power-of-two rows, rows over 1024), 2-D and
  3-D rows, strided inputs, written over its input, into another dtype, and many rows (the
  multi-row programs prefill takes); fp32 to 1e-6, fp16 to 1 ulp with >= 99% of the values equal
  (the interpreter rounds fp16 to nearest even, as the GPU does, so every intermediate rounding
  of the torch ops is checked: a missed one breaks the equal fraction), bf16 to 3 ulps (the
  interpreter truncates bf16; the GPU test holds it to 1 ulp).
- ``rope_cos_sin`` against the torch maths up to 1M positions, with and without a YaRN factor.
- DeepSeek V4's ``project`` / indexer ``queries`` / ``output`` through the kernels against the same
  layer on the torch path (what runs on the CPU), fp32 and bf16.
- Bad arguments name the problem.
On the CPU without the interpreter the layers take the torch path: the output is the reference's
bit for bit."""

from __future__ import annotations

import sys

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.interpreter import run_under_interpreter
from sglang.test.run import run_this_file
from sglang.test.tolerance import ulp

register_cpu_ci(est_time=20)


def assert_ulp_close(
    got: torch.Tensor, ref: torch.Tensor, ulps: float, atol: torch.Tensor | float
) -> None:
    """``got`` within ``ulps`` units in the last place of ``ref`` (in got's dtype) plus ``atol``."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, ref.dtype)
    g, r = got.double(), ref.double()
    assert torch.isfinite(g).all()
    spacing = ulp(r, got.dtype)
    bound = ulps * spacing + atol
    bad = (g - r).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} values off, worst {float((g - r).abs().max())}"


def _rope_tables(
    t: int, half: int, gen: torch.Generator, max_pos: int = 1 << 20
) -> tuple[torch.Tensor, torch.Tensor]:
    from sglang.kernels.ops.attention.rope import rope_cos_sin_torch

    pos = torch.randint(0, max_pos, (t,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half)))
    return rope_cos_sin_torch(pos, inv_freq, 1.0)


def _check_norm_rope(gen: torch.Generator) -> None:
    from sglang.kernels.ops.attention import norm_rope as kernel_module
    from sglang.kernels.ops.attention.norm_rope import RowNorm, norm_rope, norm_rope_torch

    # The GPU's tiles (a row a program at decode, several at prefill), not the interpreter's.
    kernel_module._rows_per_program = kernel_module.gpu_rows_per_program

    # (tokens, heads, D, rope): V4-like, odd nope width, non-power-of-two D, all rope, a 2-D row
    # (heads None), a wide row without rope, many rows (the multi-row programs of prefill)
    shapes = [(3, 4, 64, 16), (2, 3, 41, 10), (5, 2, 24, 24), (4, None, 48, 8), (2, 1, 1536, 0)]
    shapes.append((300, 4, 32, 8))
    modes = [(n, inv) for n in ("none", "unweighted", "weighted") for inv in (False, True)]
    # The interpreter is slow (~20 ms a program): each dtype sees every shape and, across them,
    # every (norm, direction); fp16, the exact check, sees every pair of them.
    for k, dtype in enumerate((torch.float16, torch.float32, torch.bfloat16)):
        for i, (t, h, d, rope) in enumerate(shapes):
            shape = (t, d) if h is None else (t, h, d)
            x = (torch.randn(shape, generator=gen) * 3).to(dtype)
            w = torch.rand(d, generator=gen) + 0.5
            cos, sin = _rope_tables(t, rope // 2, gen) if rope else (None, None)
            picked = modes if dtype == torch.float16 and t < 100 else [modes[(i + k) % 6]]
            for norm, inverse in picked:
                kw = {"norm": RowNorm(norm, w, 1e-6), "inverse": inverse}
                ref = norm_rope_torch(x, cos, sin, **kw)  # type: ignore[arg-type]
                got = norm_rope(x, cos, sin, out=torch.empty_like(x), **kw)  # type: ignore[arg-type]
                _compare(got, ref)
                if dtype == torch.float16 and norm == "unweighted":
                    inplace = x.clone()
                    norm_rope(inplace, cos, sin, out=inplace, **kw)  # type: ignore[arg-type]
                    assert torch.equal(inplace, got)
                if dtype == torch.float32 and rope:  # the output's fp32 -> bf16, same kernel
                    ref16 = norm_rope_torch(x, cos, sin, dtype=torch.bfloat16, **kw)  # type: ignore[arg-type]
                    got16 = torch.empty_like(x, dtype=torch.bfloat16)
                    norm_rope(x, cos, sin, out=got16, **kw)  # type: ignore[arg-type]
                    _compare(got16, ref16)
    # Strided rows: every other head of a wider tensor, into a strided output.
    big = torch.randn(3, 8, 32, generator=gen).to(torch.float16)
    x = big[:, ::2]
    cos, sin = _rope_tables(3, 4, gen)
    out = torch.zeros(3, 4, 64, dtype=torch.float16)[..., 16:48]
    norm_rope(x, cos, sin, out=out, norm=RowNorm.unweighted(1e-6))
    _compare(out, norm_rope_torch(x, cos, sin, norm=RowNorm.unweighted(1e-6)))


def _compare(got: torch.Tensor, ref: torch.Tensor) -> None:
    # A rotation may cancel to ~0; its error stays that of its inputs, which are of the row's size.
    row = ref.float().abs().amax(dim=-1, keepdim=True)
    if got.dtype == torch.float32:
        assert_ulp_close(got, ref, 8, 4 * 2.0**-23 * row)
    elif got.dtype == torch.float16:
        assert_ulp_close(got, ref, 1, 4 * 2.0**-23 * row)
        equal = float((got == ref).float().mean())
        assert equal >= 0.99, f"only {equal:.3f} of the fp16 values equal the torch ops'"
    else:  # the interpreter truncates to bf16, the normed inputs of the rotation too
        assert_ulp_close(got, ref, 2, 2.0**-7 * row)


def _check_cos_sin(gen: torch.Generator) -> None:
    from sglang.kernels.ops.attention.rope import rope_cos_sin_torch
    from sglang.kernels.ops.attention.rope_cos_sin import rope_cos_sin
    from sglang.srt.layers.rotary_embedding import RopeSpec, YarnScaling, rope_inv_freq

    yarn = YarnScaling(16.0, 4096, attention_factor=1.25)
    for spec in (RopeSpec(64, 10000.0), RopeSpec(64, 160000.0, yarn), RopeSpec(12, 50.0)):
        inv = rope_inv_freq(spec)
        for pos in (torch.randint(0, 1 << 20, (37,), generator=gen), torch.arange(6).view(2, 3)):
            c, s = rope_cos_sin(pos, inv, spec.attention_factor)
            rc, rs = rope_cos_sin_torch(pos, inv, spec.attention_factor)
            assert c.shape == rc.shape == (*pos.shape, spec.rope_dim // 2)
            # numpy's and torch's fp32 trig: the same argument, a few ulps of the result
            torch.testing.assert_close(c, rc, atol=4e-7, rtol=0)
            torch.testing.assert_close(s, rs, atol=4e-7, rtol=0)
    empty = rope_cos_sin(torch.zeros(0, dtype=torch.int64), inv, 1.0)
    assert empty[0].shape == (0, 6)


def _check_bad_arguments() -> None:
    from sglang.kernels.ops.attention.norm_rope import RowNorm, norm_rope
    from sglang.kernels.ops.attention.rope_cos_sin import rope_cos_sin

    x = torch.randn(2, 3, 16)
    cos = torch.randn(2, 4)
    cases = [
        (lambda: norm_rope(x, out=torch.empty(2, 3, 8)), "out has shape"),
        (lambda: norm_rope(x, cos, cos, out=x, norm=RowNorm("weighted")), "needs a weight"),
        (lambda: norm_rope(x, cos, None, out=x), "come together"),
        (lambda: norm_rope(x, cos[:1], cos[:1], out=x), "cos must be fp32 (2, 4)"),
        (lambda: norm_rope(x, torch.randn(2, 9), torch.randn(2, 9), out=x), "exceeds the head"),
        (lambda: norm_rope(x, out=x.transpose(0, 1)), "out has shape"),
        (lambda: rope_cos_sin(torch.zeros(3), torch.ones(2), 1.0), "positions are"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            call()


def _attention_layer(dtype: torch.dtype, gen: torch.Generator):  # -> DeepseekV4Attention
    from sglang.srt.layers.attention.dsv4_attention import DeepseekV4Attention
    from sglang.srt.layers.attention.dsv4_attention_config import DeepseekV4AttentionConfig
    from sglang.srt.layers.build_spec import LayerBuildSpec
    from sglang.srt.layers.rotary_embedding import RopeSpec, YarnScaling
    from sglang.test.random_params import randomize_params_

    cfg = DeepseekV4AttentionConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=24,
        o_lora_rank=8,
        o_groups=2,
        sliding_window=8,
        kind="csa",
        compress_ratio=4,
        rope=RopeSpec(8, 160000.0, YarnScaling(4.0, 64)),
        index_n_heads=4,
        index_head_dim=16,
        index_topk=4,
        q_head_norm=True,
        rms_norm_eps=1e-6,
    )
    attn = DeepseekV4Attention(cfg, 0, LayerBuildSpec(dtype=dtype, device="cpu"))
    randomize_params_(attn, gen, vector_scale=0.1)
    with torch.no_grad():  # norm weights away from 1, so a dropped weight shows
        for norm in (attn.q_norm, attn.kv_norm):
            norm.weight.copy_(1.0 + 0.3 * torch.randn(norm.weight.shape, generator=gen))
    return attn


def _check_attention_layer(gen: torch.Generator) -> None:
    from sglang.srt.layers import norm_rope, rotary_embedding

    real = norm_rope.triton_can_run
    for dtype in (torch.float32, torch.bfloat16):
        attn = _attention_layer(dtype, gen)
        assert attn.indexer is not None
        t = 5
        x = torch.randn(t, 64, generator=gen).to(dtype)
        pos = torch.randint(0, 5000, (t,), generator=gen)
        o = torch.randn(t, attn.n_local_heads, attn.head_dim, generator=gen)
        with torch.no_grad():
            p = attn.project(x, pos)
            fused = (p, *attn.indexer.queries(p.q_lora, x, p.cos, p.sin), attn.output(o, p, dtype))
            for mod in (norm_rope, rotary_embedding):  # the torch path, as on a CPU
                mod.triton_can_run = lambda t: False  # type: ignore[attr-defined]
            p = attn.project(x, pos)
            ref = (p, *attn.indexer.queries(p.q_lora, x, p.cos, p.sin), attn.output(o, p, dtype))
            for mod in (norm_rope, rotary_embedding):
                mod.triton_can_run = real  # type: ignore[attr-defined]
        pf, pr = fused[0], ref[0]
        pairs = [(pf.cos, pr.cos), (pf.sin, pr.sin), (pf.q_lora, pr.q_lora), (pf.q, pr.q)]
        pairs += [(pf.kv, pr.kv), *zip(fused[1:], ref[1:])]
        for i, (got, want) in enumerate(pairs):
            assert got.dtype == want.dtype and got.shape == want.shape, i
            # bf16: a few interpreter truncations (rounding to nearest on the GPU) compound
            # through the projections (q_lora feeds wq_b); fp32: summation order only
            rtol, atol = (3e-2, 3e-2) if dtype == torch.bfloat16 else (2e-5, 2e-5)
            torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def _interp_main() -> None:
    gen = torch.Generator().manual_seed(0)
    _check_norm_rope(gen)
    _check_cos_sin(gen)
    _check_bad_arguments()
    _check_attention_layer(gen)
    print("NORM_ROPE_INTERP_OK")


def test_kernels_under_interpreter() -> None:
    run_under_interpreter(marker="NORM_ROPE_INTERP_OK", argv=[__file__, "--interp"])


def test_cpu_takes_the_torch_ops() -> None:
    """Without the interpreter a CPU tensor takes the torch composition, bit for bit."""
    from sglang.kernels.ops.attention.rope import apply_interleaved_rope
    from sglang.kernels.ops.triton_dispatch import interpreter_enabled
    from sglang.srt.layers.layernorm import rms_norm
    from sglang.srt.layers.norm_rope import RowNorm, norm_rope

    if interpreter_enabled():
        pytest.skip("TRITON_INTERPRET is set: CPU tensors go to the kernel")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 16, generator=gen).to(torch.bfloat16)
    w = torch.rand(16, generator=gen) + 0.5
    cos, sin = _rope_tables(3, 4, gen)
    got = norm_rope(x, cos, sin, norm=RowNorm.weighted(w, 1e-6), dtype=torch.float32)
    want = apply_interleaved_rope(rms_norm(x, w, 1e-6), cos, sin).float()
    assert got.dtype == torch.float32 and torch.equal(got, want)


if __name__ == "__main__":
    if "--interp" in sys.argv:
        _interp_main()
    else:
        run_this_file(__file__)
