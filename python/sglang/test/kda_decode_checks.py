"""The KDA decode kernels against their torch forms, shared by the interpreter test
(``test/registered/kernels/test_kda_decode_kernels.py``: CPU tensors under
``TRITON_INTERPRET=1``) and the GPU test beside it. Fresh random inputs everywhere: states and
conv rows random (never zeros), decays ``g < 0`` as the safe gate makes them, ``beta`` in (0, 1).

- recurrent step vs ``kda_recurrent`` (one token), per-request states updated in place through
  the address table, decode rows scattered over a larger batch: output and final state to 2e-6 of
  their largest entry (fp32; only summation orders and exp differ, ~1e-7 measured). Batch rows
  that are not decode rows stay untouched.
- conv decode vs ``causal_conv_decode``: the shifted states bit-identical, the output within one
  rounding step of its dtype (the interpreter truncates to bf16, the GPU rounds) plus 1e-6.
- the layer's decode (kernels) vs its torch path on a batch that mixes prefill and decode rows:
  fp32 model to 1e-5 (summation orders apart, the unit tests' bound between the two forms),
  bf16 by relative Frobenius error (both round q/k/v; a 1-ulp flip moves a row).
- the reasons the layer falls back to torch.
"""

from __future__ import annotations

import torch

from sglang.kernels.ops.kda.conv_decode import kda_conv_decode_
from sglang.kernels.ops.kda.recurrent_step import default_block_v, kda_recurrent_step_
from sglang.kernels.ops.pointer_table import int64_on_device
from sglang.srt.environ import envs
from sglang.srt.layers.attention import kda as kda_mod
from sglang.srt.layers.attention.kda import KDAConfig, KDASegment, KimiDeltaAttention
from sglang.srt.layers.attention.kda_conv import causal_conv_decode
from sglang.srt.layers.attention.kda_decode import kernel_decode_reason
from sglang.srt.layers.attention.kda_gate import kda_forget_gate, l2norm
from sglang.srt.layers.attention.kda_recurrent import kda_recurrent
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.mem_cache.kimi_k3_cache import KDAState
from sglang.test.random_params import randomize_params_

STEP_TOL = 2e-6  # of the largest entry, fp32

# (B decode rows, T batch rows, H, K, V, input dtype, l2norm in the kernel, block_v or None)
STEP_CASES = [
    (1, 1, 1, 16, 16, torch.float32, False, None),
    (3, 7, 2, 16, 32, torch.float32, True, 8),
    (2, 2, 3, 32, 16, torch.bfloat16, True, 16),
    (4, 9, 2, 64, 64, torch.float32, True, 32),
    (2, 3, 2, 128, 128, torch.bfloat16, True, None),
]


def _ptrs(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return int64_on_device([t.data_ptr() for t in tensors], device)


def _rel_max(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _step_inputs(
    b: int, t: int, h: int, dk: int, dv: int, dtype: torch.dtype, gen: torch.Generator, dev: str
) -> dict[str, torch.Tensor]:
    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev)

    return {
        "q": rnd(b, h, dk).to(dtype),
        "k": rnd(b, h, dk).to(dtype),
        "v": rnd(b, h, dv).to(dtype),
        # the safe gate's range (-5, 0), strong and weak decays both present
        "g": kda_forget_gate(rnd(t, h, dk) * 3, rnd(h) * 0.5, -5.0),
        "beta": torch.rand(t, h, generator=gen, device=dev) * 0.98 + 0.01,
    }


def check_recurrent_step(dev: str) -> None:
    gen = torch.Generator(dev).manual_seed(0)
    for b, t, h, dk, dv, dtype, norm, block_v in STEP_CASES:
        x = _step_inputs(b, t, h, dk, dv, dtype, gen, dev)
        rows = torch.randperm(t, generator=gen, device=dev)[:b]
        states = [torch.randn(h, dv, dk, generator=gen, device=dev) * 0.5 for _ in range(b)]
        start = torch.stack(states)
        out = torch.full((t, h, dv), 3.0, device=dev)
        q, k = x["q"].float(), x["k"].float()
        if norm:
            q, k = l2norm(q) * dk**-0.5, l2norm(k)
        kw = {"l2norm_eps": 1e-6, "q_scale": dk**-0.5} if norm else {}
        kda_recurrent_step_(
            x["q"] if norm else q,
            x["k"] if norm else k,
            x["v"],
            x["g"],
            x["beta"],
            rows,
            _ptrs(states, torch.device(dev)),
            out,
            block_v=block_v,
            **kw,
        )
        one = [t_[:, None] for t_ in (q, k, x["v"].float(), x["g"][rows], x["beta"][rows])]
        want_o, want_s = kda_recurrent(*one, start)
        case = (b, t, h, dk, dv, dtype, norm, block_v)
        err_o, err_s = _rel_max(out[rows], want_o[:, 0]), _rel_max(torch.stack(states), want_s)
        assert err_o < STEP_TOL and err_s < STEP_TOL, (case, err_o, err_s)
        others = torch.ones(t, dtype=torch.bool, device=dev)
        others[rows] = False
        assert bool((out[others] == 3.0).all()), case


def check_conv_decode(dev: str) -> None:
    gen = torch.Generator(dev).manual_seed(1)
    # C = 1100 spans two channel blocks, the second partial.
    for b, t, c, width, dtype in [
        (1, 1, 48, 4, torch.bfloat16),
        (3, 6, 1100, 4, torch.bfloat16),
        (2, 2, 64, 2, torch.float32),
        (4, 5, 96, 3, torch.float32),
    ]:
        x = torch.randn(t, c, generator=gen, device=dev).to(dtype)
        w = torch.randn(c, width, generator=gen, device=dev) * 0.5
        rows = torch.randperm(t, generator=gen, device=dev)[:b]
        states = [torch.randn(width - 1, c, generator=gen, device=dev).to(dtype) for _ in range(b)]
        want, want_states = causal_conv_decode(x[rows], w, torch.stack(states))
        got = torch.empty(b, c, dtype=dtype, device=dev)
        kda_conv_decode_(x, w, rows, _ptrs(states, torch.device(dev)), got)
        assert torch.equal(torch.stack(states), want_states), (b, c, width, dtype)
        # one rounding step of the dtype, relative (fp32: a few ulps of summation order), plus
        # the fp32 sum's own error where the taps cancel
        step = 2.0**-7 if dtype == torch.bfloat16 else 2e-6
        excess = (got.float() - want.float()).abs() / (want.float().abs() * step + 1e-6)
        assert float(excess.max()) <= 1.0, (b, c, width, dtype, float(excess.max()))


def kda_test_layer(dtype: torch.dtype, dev: str, heads: int, head_dim: int) -> KimiDeltaAttention:
    """A KDA layer (hidden 64, conv 4, safe gate, full-rank output gate), every parameter
    random."""
    cfg = KDAConfig(64, heads, head_dim, 4, gate_lower_bound=-5.0, full_rank_gate=True)
    layer = KimiDeltaAttention(cfg, LayerBuildSpec(dtype=dtype, device=dev))
    randomize_params_(layer, torch.Generator(dev).manual_seed(2), vector_scale=0.5)
    return layer


def _random_states(
    layer: KimiDeltaAttention, n: int, dtype: torch.dtype, gen: torch.Generator, dev: str
) -> list[KDAState]:
    d = layer.config.head_dim
    return [
        KDAState(
            torch.randn(3, 3 * layer.local_width, generator=gen, device=dev).to(dtype),
            torch.randn(layer.local_heads, d, d, generator=gen, device=dev) * 0.3,
        )
        for _ in range(n)
    ]


@torch.no_grad()
def _forward(
    layer: KimiDeltaAttention, x: torch.Tensor, states: list[KDAState], kernels: bool
) -> torch.Tensor:
    # Request 1 is a 5-row prefill chunk between single-token decodes.
    lengths = [1, 5, 1, 1]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    segs = [KDASegment(s, n, st) for s, n, st in zip(starts, lengths, states)]
    real = kda_mod.kernel_decode_reason
    if not kernels:
        kda_mod.kernel_decode_reason = lambda *a: "torch path for the test"  # type: ignore[assignment]
    try:
        with envs.SGLANG_K3_KDA_PREFILL.override(None if kernels else "torch"):
            return layer(x, segs)
    finally:
        kda_mod.kernel_decode_reason = real


def check_layer_decode(dev: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        layer = kda_test_layer(dtype, dev, heads=4, head_dim=16)
        gen = torch.Generator(dev).manual_seed(3)
        states = _random_states(layer, 4, dtype, gen, dev)
        ref = [KDAState(s.conv.clone(), s.recurrent.clone()) for s in states]
        x = torch.randn(8, 64, generator=gen, device=dev).to(dtype)
        assert kernel_decode_reason(x, layer.conv_weight(), states, 4, 16) is None
        got = _forward(layer, x, states, kernels=True)
        want = _forward(layer, x, ref, kernels=False)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for a, b in zip(states, ref):
                torch.testing.assert_close(a.recurrent, b.recurrent, rtol=1e-5, atol=1e-5)
                assert torch.equal(a.conv, b.conv)
        else:
            rel = float((got.float() - want.float()).norm() / want.float().norm())
            assert rel < 2.5e-2, rel
            for a, b in zip(states, ref):
                assert torch.equal(a.conv, b.conv)
                rel = float((a.recurrent - b.recurrent).norm() / b.recurrent.norm())
                assert rel < 2.5e-2, rel


def check_fallback_reasons(dev: str) -> None:
    layer = kda_test_layer(torch.float32, dev, heads=2, head_dim=16)
    gen = torch.Generator(dev).manual_seed(4)
    mixed = torch.randn(2, 3 * layer.local_width, device=dev)
    w = layer.conv_weight()
    ok = _random_states(layer, 2, torch.float32, gen, dev)
    assert kernel_decode_reason(mixed, w, ok, 2, 16) is None
    bf16 = [KDAState(s.conv, s.recurrent.to(torch.bfloat16)) for s in ok]
    assert "recurrent state must be contiguous" in str(kernel_decode_reason(mixed, w, bf16, 2, 16))
    shared = [ok[0], ok[0]]
    assert "share" in str(kernel_decode_reason(mixed, w, shared, 2, 16))
    strided = [KDAState(s.conv, s.recurrent.transpose(1, 2)) for s in ok]
    assert "contiguous" in str(kernel_decode_reason(mixed, w, strided, 2, 16))
    assert "power of two" in str(kernel_decode_reason(mixed, w, ok, 2, 12))
    assert "conv state" in str(kernel_decode_reason(mixed.bfloat16(), w, ok, 2, 16))
    assert default_block_v(128) == 16 and default_block_v(8) == 8


def run_all(dev: str) -> None:
    check_recurrent_step(dev)
    check_conv_decode(dev)
    check_layer_decode(dev)
    check_fallback_reasons(dev)
