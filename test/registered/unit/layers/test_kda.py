"""KDA (Kimi Delta Attention) against transformers' pure-torch KDA, with every parameter random.

References (transformers 5.23): ``KimiLinearDeltaAttention`` (plain softplus gate, low-rank output
gate) and ``Glm5NextTextLinearAttention`` (the same layer with the safe gate, K3's form). Their
prefill runs the chunked KDA and their cached single-token steps the recurrent one, so both paths
are compared. Also: our chunked form equals our recurrent form, a mixed batch equals each request
alone, the full-rank gate, A_log's accepted shapes and a simulated TP=2 split.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch
from torch import nn
from transformers import DynamicCache, KimiLinearConfig
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention
from transformers.models.kimi_linear import modeling_kimi_linear as tf_kimi
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from sglang.srt.layers import linear as linear_mod
from sglang.srt.layers.attention.kda import KDAConfig, KDASegment, KimiDeltaAttention
from sglang.srt.layers.attention.kda_chunk import kda_chunked
from sglang.srt.layers.attention.kda_gate import kda_forget_gate, l2norm
from sglang.srt.layers.attention.kda_recurrent import kda_recurrent
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.linear import WeightShapeError
from sglang.srt.mem_cache.kimi_k3_cache import KDAState
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=5)

# transformers logs that it falls back to its pure-torch KDA: that fallback is what we compare to.
logging.getLogger("transformers").setLevel(logging.ERROR)

HIDDEN, HEADS, HEAD_DIM, CONV = 48, 4, 16, 4


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: elementwise, only summation order differs. bf16: both sides round projections and
    the core output (each is ~1% from an fp32 run, relative Frobenius), so compare as a whole."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        return
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert rel < 2.5e-2, f"relative error {rel:.3g}"


def _tf_layer(safe: bool) -> nn.Module:
    common: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
    }
    lin = {
        "num_heads": HEADS,
        "head_dim": HEAD_DIM,
        "short_conv_kernel_size": CONV,
        "kda_layers": [1],
        "full_attn_layers": [],
    }
    cfg: Any
    if safe:
        cfg = Glm5NextTextConfig(  # type: ignore[call-arg]
            **common,
            linear_attn_config={**lin, "gate_lower_bound": -5.0},
            layer_types=["linear_attention"],
        )
        layer: nn.Module = Glm5NextTextLinearAttention(cfg, 0).eval()
    else:
        cfg = KimiLinearConfig(**common, linear_attn_config=lin)  # type: ignore[call-arg]
        layer = KimiLinearDeltaAttention(cfg, 0).eval()
    setattr(layer, "tf_config", cfg)  # noqa: B010 - the cache needs it to know the layer types
    return layer


@torch.no_grad()
def _randomize(module: nn.Module, seed: int) -> None:
    """Every parameter random at a sensible scale (none left at transformers' 0/1 inits)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=g))
        elif name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif "conv1d" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def _load(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(module.named_parameters())
    assert set(params) == set(tensors), set(params) ^ set(tensors)
    for name, full in tensors.items():
        loader = getattr(params[name], "weight_loader", None)
        if loader is None:
            with torch.no_grad():
                params[name].copy_(full)
        else:
            loader(params[name], full)


def _ours_from(
    tf: nn.Module,
    *,
    safe: bool,
    dtype: torch.dtype,
    tp_rank: int = 0,
    tp_size: int = 1,
    full_rank: bool = False,
) -> KimiDeltaAttention:
    cfg = KDAConfig(
        HIDDEN,
        HEADS,
        HEAD_DIM,
        CONV,
        gate_lower_bound=-5.0 if safe else None,
        full_rank_gate=full_rank,
    )
    ours = KimiDeltaAttention(cfg, LayerBuildSpec(dtype=dtype, tp_rank=tp_rank, tp_size=tp_size))
    sd = {k: v.detach().clone() for k, v in tf.state_dict().items()}
    conv_q, conv_k, conv_v = sd.pop("conv1d.weight").chunk(3, dim=0)
    tensors = {
        "q_conv1d.weight": conv_q,
        "k_conv1d.weight": conv_k,
        "v_conv1d.weight": conv_v,
        **{k.removeprefix("forget_gate."): v for k, v in sd.items()},
    }
    if full_rank:
        tensors["g_proj.weight"] = tensors.pop("g_b_proj.weight") @ tensors.pop("g_a_proj.weight")
    _load(ours, tensors)
    return ours


def _state(layer: KimiDeltaAttention, dtype: torch.dtype) -> KDAState:
    width = layer.local_width
    return KDAState(
        torch.zeros(CONV - 1, 3 * width, dtype=dtype),
        torch.zeros(layer.local_heads, HEAD_DIM, HEAD_DIM),
    )


def _run(layer: KimiDeltaAttention, x: torch.Tensor, state: KDAState) -> torch.Tensor:
    with torch.no_grad():
        return layer(x, [KDASegment(0, x.shape[0], state)])


def _x(t: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- the core maths ----------------------------------------------------------------------------


@pytest.mark.parametrize("t,chunk", [(1, 64), (63, 64), (150, 64), (41, 16)])
@pytest.mark.parametrize("safe", [True, False], ids=["safe-gate", "softplus-gate"])
def test_core_chunked_equals_recurrent_and_transformers(t: int, chunk: int, safe: bool) -> None:
    g_ = torch.Generator().manual_seed(t)
    h, dk, dv = 3, 16, 8
    q, k = torch.randn(t, h, dk, generator=g_), torch.randn(t, h, dk, generator=g_)
    v = torch.randn(t, h, dv, generator=g_)
    # Strong decay (pre-activations up to ~+-6) so a chunk decays far past fp32's exp range.
    g = kda_forget_gate(
        torch.randn(t, h, dk, generator=g_) * 3,
        torch.randn(h, generator=g_),
        -5.0 if safe else None,
    )
    beta = torch.rand(t, h, generator=g_)
    s0 = torch.randn(h, dv, dk, generator=g_) * 0.3
    qn, kn = l2norm(q) * dk**-0.5, l2norm(k)
    o_c, s_c = kda_chunked(qn, kn, v, g, beta, s0, chunk_size=chunk)
    o_r, s_r = kda_recurrent(qn[None], kn[None], v[None], g[None], beta[None], s0[None])
    # fp32 with different summation orders; measured max |diff| ~1.4e-5 on states of size ~1.
    torch.testing.assert_close(o_c, o_r[0], rtol=5e-5, atol=5e-5)
    torch.testing.assert_close(s_c, s_r[0], rtol=5e-5, atol=5e-5)
    # transformers' state is [B, H, K, V]; ours is V-major [H, V, K].
    init = s0.transpose(-1, -2)[None]
    for fn in (tf_kimi.chunk_kimi_delta_attention, tf_kimi.recurrent_kimi_delta_attention):
        o_t, s_t = fn(
            q[None],
            k[None],
            v[None],
            g=g[None],
            beta=beta[None],
            initial_state=init,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(o_c, o_t[0], rtol=5e-5, atol=5e-5)
        torch.testing.assert_close(s_c, s_t[0].transpose(-1, -2), rtol=5e-5, atol=5e-5)


def test_safe_gate_is_bounded() -> None:
    a = torch.linspace(-200, 200, 101).view(1, 1, 101).expand(1, 2, 101)
    g = kda_forget_gate(a, torch.tensor([0.0, 3.0]), -5.0)
    assert torch.all(g <= 0) and torch.all(g >= -5.0) and torch.isfinite(g).all()


# --- the whole layer ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("safe", [True, False], ids=["safe-gate", "softplus-gate"])
def test_layer_prefill_and_decode_match_transformers(safe: bool, dtype: torch.dtype) -> None:
    tf = _tf_layer(safe)
    _randomize(tf, seed=1)
    ours = _ours_from(tf, safe=safe, dtype=dtype)
    tf = tf.to(dtype)
    x = _x(100, seed=2, dtype=dtype)
    with torch.no_grad():
        # no cache: one chunked prefill over two chunks
        want_full = tf(x[None])[0]
        # with a cache: prefill 37, a 30-token continuation (chunked on a state), 5 single steps
        cache = DynamicCache(config=getattr(tf, "tf_config"))  # noqa: B009
        pieces = [(0, 37), (37, 67), *[(i, i + 1) for i in range(67, 72)]]
        want_pieces = [tf(x[None, lo:hi], cache_params=cache)[0] for lo, hi in pieces]
    state = _state(ours, dtype)
    got_full = _run(ours, x, _state(ours, dtype))
    got_pieces = [_run(ours, x[lo:hi], state) for lo, hi in pieces]
    _close(got_full, want_full, dtype)
    for got, want in zip(got_pieces, want_pieces):
        _close(got, want, dtype)
    tf_states = cache.get_recurrent_state(0, state_idx=0)
    assert tf_states is not None
    tf_state = tf_states[0]  # [H, K, V]; ours is V-major
    _close(state.recurrent, tf_state.transpose(-1, -2).float(), dtype)
    # our own forms agree: the pieces (chunked + recurrent) equal the first 72 rows of one prefill
    _close(torch.cat(got_pieces), got_full[:72], dtype)


@pytest.mark.parametrize("seed", range(6))
def test_random_pieces_match_transformers_cache(seed: int) -> None:
    """A sweep over how a request's rows arrive: random pieces of 1, 2, 3 (shorter than the conv
    kernel's 3-row state), 5, 63, 64 or 65 rows (around the 64-row chunk) through our layer and
    through transformers' cached layer, alternating gate kinds; every piece's output and the
    final recurrent state agree, so the conv and recurrent states carry across any boundary."""
    rng = random.Random(seed)
    safe = seed % 2 == 0
    tf = _tf_layer(safe)
    _randomize(tf, seed=100 + seed)
    ours = _ours_from(tf, safe=safe, dtype=torch.float32)
    sizes: list[int] = []
    while sum(sizes) < 200:
        sizes.append(rng.choice((1, 1, 2, 3, 5, 63, 64, 65)))
    x = _x(sum(sizes), seed=200 + seed)
    cache = DynamicCache(config=getattr(tf, "tf_config"))  # noqa: B009
    state = _state(ours, torch.float32)
    lo = 0
    for n in sizes:
        with torch.no_grad():
            want = tf(x[None, lo : lo + n], cache_params=cache)[0]
        _close(_run(ours, x[lo : lo + n], state), want, torch.float32)
        lo += n
    tf_states = cache.get_recurrent_state(0, state_idx=0)
    assert tf_states is not None
    _close(state.recurrent, tf_states[0].transpose(-1, -2).float(), torch.float32)


def test_full_rank_gate_equals_low_rank_product() -> None:
    tf = _tf_layer(safe=True)
    _randomize(tf, seed=3)
    low = _ours_from(tf, safe=True, dtype=torch.float32)
    full = _ours_from(tf, safe=True, dtype=torch.float32, full_rank=True)
    assert full.g_proj is not None and low.g_proj is None
    x = _x(20, seed=4)
    torch.testing.assert_close(
        _run(full, x, _state(full, x.dtype)),
        _run(low, x, _state(low, x.dtype)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_mixed_batch_equals_each_request_alone() -> None:
    tf = _tf_layer(safe=True)
    _randomize(tf, seed=5)
    layer = _ours_from(tf, safe=True, dtype=torch.float32, full_rank=True)
    prefixes = [_x(n, seed=10 + n) for n in (5, 70, 1)]
    # Alone: each request's prefix, then its next rows.
    nxt = [_x(n, seed=20 + n) for n in (1, 1, 9)]
    alone_states = [_state(layer, torch.float32) for _ in prefixes]
    alone = []
    for p, n, s in zip(prefixes, nxt, alone_states):
        _run(layer, p, s)
        alone.append(_run(layer, n, s))
    # Batched: same prefixes, then one forward with two decode rows and a 9-row prefill chunk.
    states = [_state(layer, torch.float32) for _ in prefixes]
    for p, s in zip(prefixes, states):
        _run(layer, p, s)
    x = torch.cat(nxt)
    segs = [KDASegment(0, 1, states[0]), KDASegment(1, 1, states[1]), KDASegment(2, 9, states[2])]
    with torch.no_grad():
        got = layer(x, segs)
    torch.testing.assert_close(got, torch.cat(alone), rtol=1e-5, atol=1e-5)
    for a, b in zip(states, alone_states):
        torch.testing.assert_close(a.recurrent, b.recurrent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.conv, b.conv)


def test_a_log_accepts_release_shapes() -> None:
    layer = KimiDeltaAttention(
        KDAConfig(HIDDEN, HEADS, HEAD_DIM), LayerBuildSpec(dtype=torch.float32)
    )
    load = layer.A_log.weight_loader  # type: ignore[attr-defined]
    ref = torch.arange(HEADS, dtype=torch.float32)
    for full in (
        ref,
        ref.view(1, 1, HEADS, 1),
        torch.cat([ref, torch.full((HEAD_DIM - HEADS,), 9.0)]),
    ):
        layer.A_log.data.zero_()
        load(layer.A_log, full)
        assert torch.equal(layer.A_log.data, ref)
    with pytest.raises(WeightShapeError, match="expected shape"):
        load(layer.A_log, torch.zeros(HEADS - 1))


def test_tensor_parallel_halves_sum_to_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each rank's o_proj partial sum; the all-reduce becomes the test's own sum.
    monkeypatch.setattr(linear_mod, "tensor_model_parallel_all_reduce", lambda y: y)
    tf = _tf_layer(safe=True)
    _randomize(tf, seed=6)
    whole = _ours_from(tf, safe=True, dtype=torch.float32, full_rank=True)
    ranks = [
        _ours_from(tf, safe=True, dtype=torch.float32, full_rank=True, tp_rank=r, tp_size=2)
        for r in range(2)
    ]
    x = _x(30, seed=7)
    s_whole = _state(whole, torch.float32)
    want = _run(whole, x, s_whole)
    states = [_state(r, torch.float32) for r in ranks]
    got = sum(_run(r, x, s) for r, s in zip(ranks, states))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        torch.cat([s.recurrent for s in states]), s_whole.recurrent, rtol=1e-5, atol=1e-5
    )


if __name__ == "__main__":
    run_this_file(__file__)
