"""The fused norm + RoPE + cast kernel and the one-launch RoPE cos/sin on a GPU (skipped
elsewhere), at DeepSeek V4's bench widths, against the torch ops they replace, on fresh random
inputs:

- every use the attention makes of it (q: per-head unweighted norm + rope; kv: weighted norm +
  rope; indexer q: rope; q_norm: weighted norm on a 1024 / 1536 row; the output: inverse rope of
  fp32 rows, cast to bf16), at decode batches and a prefill chunk: bf16 to 1 ulp with >= 99% of
  the values equal (the GPU rounds to nearest even, as torch does; the rest differ by the sum of
  squares' order, the rsqrt and fused multiply-adds in the last fp32 place), fp32 to 8 ulps;
- cos/sin up to 1M positions against torch's (libdevice's cosf/sinf, as torch's CUDA kernels);
- the attention's ``project`` / indexer ``queries`` / ``output`` captured in a CUDA graph and
  replayed at new positions equal eager calls, and equal the torch path to the same bounds;
- at a prefill chunk (8192 tokens) the kernel is faster than the torch ops (it replaces ~10
  passes over the rows by one).
"""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.attention.norm_rope import RowNorm, norm_rope, norm_rope_torch
from sglang.kernels.ops.attention.rope import rope_cos_sin_torch
from sglang.kernels.ops.attention.rope_cos_sin import rope_cos_sin
from sglang.srt.layers import norm_rope as norm_rope_layer
from sglang.srt.layers import rotary_embedding
from sglang.srt.layers.rotary_embedding import RopeSpec, YarnScaling, rope_inv_freq
from sglang.srt.utils.cuda_timing import median_cuda_ms
from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file
from sglang.test.tolerance import ulp

register_cuda_ci(est_time=30, suite="h200-1gpu")

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _check(got: torch.Tensor, ref: torch.Tensor) -> None:
    """1 ulp (bf16) / 8 ulps (fp32) of the reference plus, for a rotation that cancels to ~0, an
    fp32 rounding of the row's size; bf16: at least 99% of the values equal."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    g, r = got.double(), ref.double()
    assert torch.isfinite(g).all()
    row = r.abs().amax(dim=-1, keepdim=True)
    spacing = ulp(r, got.dtype)
    ulps = 1 if got.dtype == torch.bfloat16 else 8
    bad = (g - r).abs() > ulps * spacing + 4 * 2.0**-23 * row
    assert not bad.any(), f"{int(bad.sum())} values off, worst {float((g - r).abs().max())}"
    if got.dtype == torch.bfloat16:
        equal = float((got == ref).float().mean())
        assert equal >= 0.99, f"only {equal:.4f} of the values equal the torch ops'"


def _tables(t: int, spec: RopeSpec, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 1 << 20, (t,), generator=g, device=DEV)
    return rope_cos_sin_torch(pos, rope_inv_freq(spec, DEV), spec.attention_factor)


SPEC = RopeSpec(64, 160000.0, YarnScaling(16.0, 65536))

# (name, row shape after T, rope?, norm, inverse, input dtype, output dtype)
USES = [
    ("q", (64, 512), True, "unweighted", False, torch.bfloat16, torch.bfloat16),
    ("kv", (512,), True, "weighted", False, torch.bfloat16, torch.bfloat16),
    ("indexer q", (64, 128), True, "none", False, torch.bfloat16, torch.bfloat16),
    ("q_norm 1024", (1024,), False, "weighted", False, torch.bfloat16, torch.bfloat16),
    ("q_norm 1536", (1536,), False, "weighted", False, torch.bfloat16, torch.bfloat16),
    ("output", (64, 512), True, "none", True, torch.float32, torch.bfloat16),
    ("q fp32", (16, 512), True, "unweighted", True, torch.float32, torch.float32),
    ("kv fp32", (512,), True, "weighted", False, torch.float32, torch.float32),
]


@pytest.mark.parametrize("tokens", [1, 16, 64, 8192])
@pytest.mark.parametrize("use", USES, ids=[u[0] for u in USES])
def test_kernel_matches_torch_ops(tokens: int, use: tuple) -> None:
    _, shape, rope, norm, inverse, dtype, out_dtype = use
    g = torch.Generator(DEV).manual_seed(tokens + len(shape))
    x = (torch.randn(tokens, *shape, generator=g, device=DEV) * 2).to(dtype)
    w = torch.rand(shape[-1], generator=g, device=DEV) + 0.5
    cos, sin = _tables(tokens, SPEC, g) if rope else (None, None)
    kw = {"norm": RowNorm(norm, w, 1e-6), "inverse": inverse}
    ref = norm_rope_torch(x, cos, sin, dtype=out_dtype, **kw)
    got = norm_rope(x, cos, sin, out=torch.empty_like(x, dtype=out_dtype), **kw)
    _check(got, ref)
    if out_dtype == dtype:  # written over its input, as the attention calls it
        inplace = x.clone()
        norm_rope(inplace, cos, sin, out=inplace, **kw)
        assert torch.equal(inplace, got)


def test_cos_sin_matches_torch() -> None:
    g = torch.Generator(DEV).manual_seed(0)
    for spec in (
        SPEC,
        RopeSpec(64, 10000.0),
        RopeSpec(64, 1e4, YarnScaling(4.0, 4096, 32, 1, 1.3)),
    ):
        inv = rope_inv_freq(spec, DEV)
        for pos in (
            torch.randint(0, 1 << 20, (4096,), generator=g, device=DEV),
            torch.arange(9, device=DEV),
        ):
            c, s = rope_cos_sin(pos, inv, spec.attention_factor)
            rc, rs = rope_cos_sin_torch(pos, inv, spec.attention_factor)
            dc, ds = float((c - rc).abs().max()), float((s - rs).abs().max())
            print(f"cos/sin vs torch, {spec}: {dc:.2e} {ds:.2e}")
            assert dc <= 5e-7 and ds <= 5e-7


def _wide_attention():  # -> DeepseekV4Attention
    from sglang.srt.layers.attention.dsv4_attention import DeepseekV4Attention
    from sglang.srt.layers.build_spec import LayerBuildSpec
    from sglang.test.random_params import randomize_params_
    from sglang.test.wide_dsv4 import wide_dsv4_attention_config

    cfg = wide_dsv4_attention_config()
    attn = DeepseekV4Attention(cfg, 0, LayerBuildSpec(dtype=torch.bfloat16, device=DEV))
    g = torch.Generator(DEV).manual_seed(3)
    randomize_params_(attn, g, vector_scale=0.1)
    with torch.no_grad():
        for n in (attn.q_norm, attn.kv_norm):
            n.weight.copy_(1.0 + 0.3 * torch.randn(n.weight.shape, generator=g, device=DEV))
    return attn


@torch.no_grad()
def test_attention_graph_replay_and_torch_path() -> None:
    attn = _wide_attention()
    assert attn.indexer is not None
    bs = 16
    g = torch.Generator(DEV).manual_seed(5)
    x = torch.randn(bs, 4096, generator=g, device=DEV).to(torch.bfloat16)
    pos = torch.randint(0, 100000, (bs,), generator=g, device=DEV)
    o = torch.randn(bs, 64, 512, generator=g, device=DEV)

    def step() -> list[torch.Tensor]:
        p = attn.project(x, pos)
        iq, iw = attn.indexer.queries(p.q_lora, x, p.cos, p.sin)
        return [p.cos, p.sin, p.q_lora, p.q, p.kv, iq, iw, attn.output(o, p, torch.bfloat16)]

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    pos.copy_(torch.randint(0, 100000, (bs,), generator=g, device=DEV))
    x.copy_(torch.randn(bs, 4096, generator=g, device=DEV).to(torch.bfloat16))
    graph.replay()
    eager = step()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
    real = norm_rope_layer.triton_can_run
    try:
        norm_rope_layer.triton_can_run = rotary_embedding.triton_can_run = lambda t: False
        torch_path = step()
    finally:
        norm_rope_layer.triton_can_run = rotary_embedding.triton_can_run = real
    # cos/sin, q_lora (one norm) and kv compare per value; q and the indexer q went through
    # a GEMM of a (possibly 1-ulp different) q_lora, so they are held to the GEMM's bf16 scale.
    for i in (0, 1):
        torch.testing.assert_close(eager[i], torch_path[i], atol=5e-7, rtol=0)
    _check(eager[2], torch_path[2])
    _check(eager[4], torch_path[4])
    _check(eager[7], torch_path[7])
    for i in (3, 5, 6):
        torch.testing.assert_close(eager[i].float(), torch_path[i].float(), atol=2e-2, rtol=2e-2)


def test_prefill_kernel_faster_than_torch_ops() -> None:
    g = torch.Generator(DEV).manual_seed(9)
    t = 8192
    x = torch.randn(t, 64, 512, generator=g, device=DEV).to(torch.bfloat16)
    cos, sin = _tables(t, SPEC, g)
    out = torch.empty_like(x)
    kw = {"norm": RowNorm.unweighted(1e-6)}
    fused = median_cuda_ms(lambda: norm_rope(x, cos, sin, out=out, **kw))
    torch_ms = median_cuda_ms(lambda: norm_rope_torch(x, cos, sin, **kw))
    gb = 2 * x.numel() * x.element_size() / 1e9  # read + write
    print(f"prefill q norm+rope 8192x64x512: kernel {fused:.3f} ms ({gb / fused * 1e3:.0f} GB/s)")
    print(f"  torch ops {torch_ms:.3f} ms")
    assert fused < torch_ms


if __name__ == "__main__":
    run_this_file(__file__)
