"""The chunked KDA prefill kernels against a float64 recurrence, shared by the interpreter test
(``test/registered/kernels/test_kda_chunk_prefill.py``: CPU tensors under ``TRITON_INTERPRET=1``)
and the GPU test beside it. Fresh random inputs: q/k L2-normalised, states random (never zeros),
decays from the safe gate in (-5, 0) with mixed, strong (near -5 a token: a 16-row block decays
by ~75 nats, the factored form's edge) and weak (near 0) gates, ``beta`` in (0, 1).

- kernels vs the float64 recurrence: output and final state to ``TOLERANCE[precision]`` of their
  largest entry; the torch chunked form (fp32) is measured the same way and the kernels must not
  be worse than twice its error plus 1e-6. Outputs start as NaN, so a row the kernels miss fails.
  Lengths cover one token, partial sub-blocks and chunks, and several chunks.
- the state updated in place (``state_out is state``) equals a separate ``state_out``.
- the layer's prefill (kernels) vs its torch path on a batch mixing two prefill segments and a
  decode row: fp32 model to 1e-5, bf16 by relative Frobenius error; conv states bit-equal.
- the prefill conv kernel vs ``causal_conv_prefill``: within one rounding step of its dtype
  (plus 1e-6), with states random and segments shorter than the state; the new conv state
  equals the last ``W - 1`` rows of ``[state; x]`` exactly.
- the reasons the layer falls back to torch, and the launcher's errors.
"""

from __future__ import annotations

import torch

from sglang.kernels.ops.kda.chunk_prefill import (
    chunk_prefill_reason,
    default_block_v,
    kda_chunk_prefill_,
    max_gate_bound_magnitude,
)
from sglang.kernels.ops.kda.conv_prefill import kda_conv_prefill
from sglang.srt.environ import envs
from sglang.srt.layers.attention.kda import KDASegment, KimiDeltaAttention
from sglang.srt.layers.attention.kda_chunk import kda_chunked
from sglang.srt.layers.attention.kda_conv import causal_conv_prefill, conv_state_after
from sglang.srt.layers.attention.kda_gate import kda_forget_gate, l2norm
from sglang.srt.layers.attention.kda_prefill import prefill_kernel_reason
from sglang.srt.layers.attention.kda_recurrent import kda_recurrent
from sglang.srt.mem_cache.kimi_k3_cache import KDAState
from sglang.test.kda_decode_checks import kda_test_layer

# of the largest entry, against float64 (fp32 chunked torch: ~2-5e-6 measured)
TOLERANCE = {"ieee": 2e-5, "tf32x3": 2e-5, "tf32": 1e-2}
GATE_SHIFT = {"mixed": 0.0, "strong": 8.0, "weak": -8.0}

# (T, H, K, V, gate, block_v)
CPU_CASES = [
    (1, 1, 16, 16, "mixed", 16),
    (17, 2, 32, 16, "mixed", 16),
    (64, 1, 16, 32, "strong", 16),
    (150, 2, 32, 32, "mixed", 16),
    (70, 1, 64, 16, "strong", None),
    (90, 1, 32, 32, "weak", 32),
]


def recurrence64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kda_recurrent`` (token by token) in float64 on one sequence: ``[T, H, *]`` inputs,
    ``state [H, V, K]``."""
    o, s = kda_recurrent(*(x.double()[None] for x in (q, k, v, g, beta, state)))
    return o[0], s[0]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def prefill_inputs(
    t: int, h: int, dk: int, dv: int, gate: str, gen: torch.Generator, dev: str
) -> dict[str, torch.Tensor]:
    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev)

    return {
        "q": l2norm(rnd(t, h, dk)) * dk**-0.5,
        "k": l2norm(rnd(t, h, dk)),
        "v": rnd(t, h, dv),
        "g": kda_forget_gate(rnd(t, h, dk) * 3 + GATE_SHIFT[gate], rnd(h) * 0.5, -5.0),
        "beta": torch.rand(t, h, generator=gen, device=dev) * 0.98 + 0.01,
        "state": rnd(h, dv, dk) * 0.5,
    }


def check_against_float64(
    dev: str, cases: list[tuple[int, int, int, int, str, int | None]], precision: str
) -> None:
    gen = torch.Generator(dev).manual_seed(0)
    for case in cases:
        t, h, dk, dv, gate, block_v = case
        x = prefill_inputs(t, h, dk, dv, gate, gen, dev)
        args = [x[n] for n in ("q", "k", "v", "g", "beta")]
        want_o, want_s = recurrence64(*args, x["state"])
        torch_o, torch_s = kda_chunked(*args, x["state"])
        floor = max(_rel(torch_o, want_o), _rel(torch_s, want_s))
        out = torch.full((t, h, dv), float("nan"), device=dev)
        s_out = torch.full_like(x["state"], float("nan"))
        start = x["state"].clone()
        kda_chunk_prefill_(*args, x["state"], out, s_out, precision=precision, block_v=block_v)
        assert torch.equal(x["state"], start), ("state modified", case)
        err = max(_rel(out, want_o), _rel(s_out, want_s))
        bound = (
            TOLERANCE[precision]
            if precision == "tf32"
            else min(TOLERANCE[precision], 2 * floor + 1e-6)
        )
        assert err <= bound, (case, precision, err, floor)
        # in place: the same numbers as into a separate state
        state = x["state"].clone()
        out2 = torch.full_like(out, float("nan"))
        kda_chunk_prefill_(*args, state, out2, state, precision=precision, block_v=block_v)
        assert torch.equal(out2, out) and torch.equal(state, s_out), ("in place", case)


def _layer_forward(
    layer: KimiDeltaAttention,
    x: torch.Tensor,
    lengths: list[int],
    states: list[KDAState],
    mode: str | None,
) -> torch.Tensor:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    segs = [KDASegment(s, n, c) for s, n, c in zip(starts, lengths, states)]
    with envs.SGLANG_K3_KDA_PREFILL.override(mode):
        return layer(x, segs)


@torch.no_grad()
def check_layer_prefill(dev: str) -> None:
    lengths = [70, 1, 23]  # two prefill segments around a decode row
    for dtype in (torch.float32, torch.bfloat16):
        layer = kda_test_layer(dtype, dev, heads=2, head_dim=16)
        gen = torch.Generator(dev).manual_seed(3)
        d, width = layer.config.head_dim, 3 * layer.local_width
        states = [
            KDAState(
                torch.randn(3, width, generator=gen, device=dev).to(dtype),
                torch.randn(layer.local_heads, d, d, generator=gen, device=dev) * 0.3,
            )
            for _ in lengths
        ]
        ref = [KDAState(s.conv.clone(), s.recurrent.clone()) for s in states]
        x = torch.randn(sum(lengths), 64, generator=gen, device=dev).to(dtype)
        got = _layer_forward(layer, x, lengths, states, None)
        want = _layer_forward(layer, x, lengths, ref, "torch")
        for a, b in zip(states, ref):
            assert torch.equal(a.conv, b.conv)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for a, b in zip(states, ref):
                torch.testing.assert_close(a.recurrent, b.recurrent, rtol=1e-5, atol=1e-5)
        else:
            rel = float((got.float() - want.float()).norm() / want.float().norm())
            assert rel < 2.5e-2, rel
            for a, b in zip(states, ref):
                rel = float((a.recurrent - b.recurrent).norm() / b.recurrent.norm())
                assert rel < 2.5e-2, rel


def check_conv_prefill(dev: str) -> None:
    gen = torch.Generator(dev).manual_seed(6)
    # C = 700 spans three channel blocks, the last partial; T = 2 < W - 1 reads the state twice
    for t, c, width, dtype in [
        (2, 48, 4, torch.bfloat16),
        (77, 700, 4, torch.bfloat16),
        (40, 64, 2, torch.float32),
        (3, 96, 3, torch.float32),
    ]:
        x = torch.randn(t, c, generator=gen, device=dev).to(dtype)
        w = torch.randn(c, width, generator=gen, device=dev) * 0.5
        state = torch.randn(width - 1, c, generator=gen, device=dev).to(dtype)
        want, want_state = causal_conv_prefill(x, w, state)
        got = kda_conv_prefill(x, w, state)
        assert got.stride() == (c, 1), got.stride()
        step = 2.0**-7 if dtype == torch.bfloat16 else 2e-6
        excess = (got.float() - want.float()).abs() / (want.float().abs() * step + 1e-6)
        assert float(excess.max()) <= 1.0, (t, c, width, dtype, float(excess.max()))
        window = torch.cat([state, x], dim=0)
        assert torch.equal(conv_state_after(x, state), window[-(width - 1) :])
        assert torch.equal(want_state, window[-(width - 1) :])


def check_reasons_and_errors(dev: str) -> None:
    q = torch.zeros(2, 1, 16, device=dev)
    assert prefill_kernel_reason(q, 16, -5.0, "tf32x3") is None
    assert "asked for" in str(prefill_kernel_reason(q, 16, -5.0, "torch"))
    assert "unbounded" in str(chunk_prefill_reason(16, 16, None))
    assert "power of two" in str(chunk_prefill_reason(24, 24, -5.0))
    assert "power of two" in str(chunk_prefill_reason(8, 8, -5.0))
    assert "-5.333" in str(chunk_prefill_reason(16, 16, -6.0))
    assert chunk_prefill_reason(16, 16, -max_gate_bound_magnitude()) is None
    assert default_block_v(128, 96) == 64 and default_block_v(128, 12) == 16
    assert default_block_v(128, 12, sms=40) == 32 and default_block_v(128, 12, sms=24) == 64
    assert default_block_v(16, 1) == 16
    x = prefill_inputs(5, 1, 16, 16, "mixed", torch.Generator(dev).manual_seed(5), dev)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    out = torch.empty(5, 1, 16, device=dev)

    def raises(match: str, **kw: object) -> None:
        try:
            a = dict(zip(("q", "k", "v", "g", "beta"), args)) | {"state": x["state"]}
            a |= {"out": out, "state_out": x["state"].clone()} | kw
            kda_chunk_prefill_(**a)  # type: ignore[arg-type]
        except ValueError as e:
            assert match in str(e), (match, str(e))
        else:
            raise AssertionError(f"no error for {match}")

    raises("precision", precision="fp16")
    raises("out (5, 1, 8)", out=torch.empty(5, 1, 8, device=dev))
    raises("state_out must be fp32", state_out=x["state"].double())
    raises("block_v", block_v=24)
    raises("beta (4, 1)", beta=x["beta"][:4])


def run_all(dev: str) -> None:
    check_against_float64(dev, CPU_CASES, "ieee")
    # the interpreter computes every dot in fp32 whatever the precision: this only checks that
    # tf32x3 compiles into the kernels; its numbers are checked on the GPU
    check_against_float64(dev, CPU_CASES[:3], "tf32x3")
    check_conv_prefill(dev)
    check_layer_prefill(dev)
    check_reasons_and_errors(dev)
