"""Whole-model Kimi K3 on tiny random configs (every parameter random):

- our forward equals an independent, cache-free torch reference written from the design notes
  (AttnRes bank and partial sums, transformers' pure-torch chunked KDA, naive NoPE MLA with the
  output gate, the hand-written latent MoE), so the layer plumbing and the AttnRes order are right;
- prefill logits equal token-by-token decode through our caches, and equal a prefill split into
  chunks;
- a batch of requests of different lengths (prefill chunks and decode rows mixed) equals each
  request alone.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear import modeling_kimi_linear as tf_kimi

from sglang.srt.models.kimi_k3 import KimiK3Batch, KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_kimi_k3_moe import mlp_reference, moe_reference, rms_reference
from test_kimi_k3_tiny import CONFIG_A, CONFIG_B, CONFIG_C, make_model, tokens

register_cpu_ci(est_time=8)

CONFIGS = {"A": CONFIG_A, "B": CONFIG_B, "C": CONFIG_C}
# fp32 everywhere; the forms differ only in summation order (chunked vs recurrent KDA, expanded vs
# absorbed MLA, one GEMM over a batch vs per request). The first KDA layer differs by ~4e-6
# (relative) and 8 random layers amplify that ~40x: measured max |diff| <= 2.3e-4 on logits of
# magnitude ~5. A plumbing error (wrong row, state, bank or norm) shows up at >= 1e-2.
RTOL, ATOL = 1e-3, 5e-4


# --- the independent reference ------------------------------------------------------------------


def _kda_reference(
    model: KimiK3ForCausalLM, p: dict[str, torch.Tensor], pre: str, x: torch.Tensor
) -> torch.Tensor:
    c = model.config
    t, h, d = x.shape[0], c.kda_num_heads, c.kda_head_dim

    def conv(name: str) -> torch.Tensor:
        y = F.conv1d(
            F.pad((x @ p[f"{pre}{name}_proj.weight"].T).T[None], (c.kda_conv_size - 1, 0)),
            p[f"{pre}{name}_conv1d.weight"],
            groups=h * d,
        )
        return F.silu(y[0].T).view(1, t, h, d)

    a = (x @ p[f"{pre}f_a_proj.weight"].T @ p[f"{pre}f_b_proj.weight"].T + p[f"{pre}dt_bias"]).view(
        1, t, h, d
    )
    rate = p[f"{pre}A_log"].exp().view(1, 1, h, 1)
    lb = c.kda_gate_lower_bound
    g = lb * torch.sigmoid(rate * a) if lb is not None else -rate * F.softplus(a)
    beta = torch.sigmoid(x @ p[f"{pre}b_proj.weight"].T).view(1, t, h)
    o, _ = tf_kimi.chunk_kimi_delta_attention(
        conv("q"), conv("k"), conv("v"), g=g, beta=beta, use_qk_l2norm_in_kernel=True
    )
    if f"{pre}g_proj.weight" in p:
        gate = x @ p[f"{pre}g_proj.weight"].T
    else:
        gate = x @ p[f"{pre}g_a_proj.weight"].T @ p[f"{pre}g_b_proj.weight"].T
    o = rms_reference(o[0], p[f"{pre}o_norm.weight"], 1e-5) * torch.sigmoid(gate.view(t, h, d))
    return o.reshape(t, h * d) @ p[f"{pre}o_proj.weight"].T


def _mla_reference(
    model: KimiK3ForCausalLM, p: dict[str, torch.Tensor], pre: str, x: torch.Tensor
) -> torch.Tensor:
    c = model.config
    t, h, nope, rope, dv = (
        x.shape[0],
        c.num_attention_heads,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
    )
    eps = c.rms_norm_eps
    if c.q_lora_rank is None:
        q = x @ p[f"{pre}q_proj.weight"].T
    else:
        q = rms_reference(x @ p[f"{pre}q_a_proj.weight"].T, p[f"{pre}q_a_layernorm.weight"], eps)
        q = q @ p[f"{pre}q_b_proj.weight"].T
    q = q.view(t, h, nope + rope)
    kv_a = x @ p[f"{pre}kv_a_proj_with_mqa.weight"].T
    ckv = rms_reference(kv_a[:, : c.kv_lora_rank], p[f"{pre}kv_a_layernorm.weight"], eps)
    kv = (ckv @ p[f"{pre}kv_b_proj.weight"].T).view(t, h, nope + dv)
    k = torch.cat([kv[..., :nope], kv_a[:, None, c.kv_lora_rank :].expand(t, h, rope)], dim=-1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * (nope + rope) ** -0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hij,jhd->ihd", scores.softmax(-1), kv[..., nope:]).reshape(t, h * dv)
    if c.mla_use_output_gate:
        o = o * torch.sigmoid(x @ p[f"{pre}g_proj.weight"].T)
    return o @ p[f"{pre}o_proj.weight"].T


def reference_logits(model: KimiK3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Cache-free fp32 forward of one whole sequence, written from the design notes."""
    c = model.config
    p = {n: t.detach().float() for n, t in model.named_parameters()}
    eps = c.rms_norm_eps
    partial: torch.Tensor | None = p["model.embed_tokens.weight"][ids]
    bank: list[torch.Tensor] = []

    def read(site: str, out_norm: str) -> torch.Tensor:
        assert partial is not None
        rows = torch.stack([*bank, partial])  # [R, T, H]
        score_w = p[f"{site}_res_norm.weight"] * p[f"{site}_res_proj.weight"][0]
        alpha = ((rows / torch.sqrt(rows.pow(2).mean(-1, keepdim=True) + eps)) @ score_w).softmax(0)
        return rms_reference((alpha[..., None] * rows).sum(0), p[out_norm], eps)

    plain = c.attn_res_block_size is None
    residual = p["model.embed_tokens.weight"][ids]  # the plain residual stream, if plain
    for i, layer in enumerate(model.decoder_layers):
        pre = f"model.layers.{i}."
        if plain:
            x = rms_reference(residual, p[f"{pre}input_layernorm.weight"], eps)
        else:
            x = read(f"{pre}self_attention", f"{pre}input_layernorm.weight")
            if i % c.attn_res_block_size == 0:
                assert partial is not None
                bank.append(partial)
                partial = None
        attn = (_kda_reference if c.is_kda(i) else _mla_reference)(model, p, f"{pre}self_attn.", x)
        if plain:
            residual = residual + attn
            x = rms_reference(residual, p[f"{pre}post_attention_layernorm.weight"], eps)
        else:
            partial = attn if partial is None else partial + attn
            x = read(f"{pre}mlp", f"{pre}post_attention_layernorm.weight")
        if isinstance(layer.mlp, KimiK3MoE):
            ffn = moe_reference(layer.mlp, x, rsf=c.routed_scaling_factor, eps=eps)
        else:
            ffn = mlp_reference(x, p, f"{pre}mlp")
        if plain:
            residual = residual + ffn
        else:
            assert partial is not None
            partial = partial + ffn
    if plain:
        y = rms_reference(residual, p["model.norm.weight"], eps)
    else:
        y = read("model.output_attn", "model.norm.weight")
    return y @ p["lm_head.weight"].T


# --- tests --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models() -> dict[str, KimiK3ForCausalLM]:
    return {name: make_model(raw, seed=7) for name, raw in CONFIGS.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_equals_independent_reference(
    models: dict[str, KimiK3ForCausalLM], name: str
) -> None:
    model = models[name]
    ids = tokens(70, seed=1)  # > one 64-token KDA chunk
    torch.testing.assert_close(
        model(ids, torch.arange(70)), reference_logits(model, ids), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_equals_token_by_token_decode(
    models: dict[str, KimiK3ForCausalLM], name: str
) -> None:
    model = models[name]
    ids = tokens(20, seed=2)
    full = model.prefill(ids, model.new_request_cache())
    cache = model.new_request_cache()
    steps = [model.decode(ids[i : i + 1], [cache]) for i in range(20)]
    torch.testing.assert_close(torch.cat(steps), full, rtol=RTOL, atol=ATOL)
    assert len(cache) == 20


@pytest.mark.parametrize("name", ["A", "B"])
def test_chunked_prefill_equals_one_prefill(
    models: dict[str, KimiK3ForCausalLM], name: str
) -> None:
    model = models[name]
    ids = tokens(90, seed=3)
    full = model.prefill(ids, model.new_request_cache())
    cache = model.new_request_cache()
    parts = [model.prefill(ids[lo:hi], cache) for lo, hi in ((0, 7), (7, 12), (12, 13), (13, 90))]
    torch.testing.assert_close(torch.cat(parts), full, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["A", "B"])
def test_mixed_batch_equals_each_request_alone(
    models: dict[str, KimiK3ForCausalLM], name: str
) -> None:
    model = models[name]
    prompts = [tokens(n, seed=10 + n) for n in (9, 3, 17, 1)]
    follow = [tokens(n, seed=30 + n) for n in (1, 6, 1, 4)]
    alone = []
    for prompt, nxt in zip(prompts, follow):
        cache = model.new_request_cache()
        model.prefill(prompt, cache)
        alone.append(model.prefill(nxt, cache))
    # batched: all prompts in one forward, then decode rows and prefill chunks in one forward
    caches = [model.new_request_cache() for _ in prompts]
    ids = torch.cat(prompts)
    pos = torch.cat([torch.arange(p.shape[0]) for p in prompts])
    first = model(ids, pos, KimiK3Batch([p.shape[0] for p in prompts], caches))
    ids2 = torch.cat(follow)
    pos2 = torch.cat(
        [torch.arange(p.shape[0], p.shape[0] + f.shape[0]) for p, f in zip(prompts, follow)]
    )
    second = model(ids2, pos2, KimiK3Batch([f.shape[0] for f in follow], caches))
    torch.testing.assert_close(second, torch.cat(alone), rtol=RTOL, atol=ATOL)
    alone_first = [model.prefill(p, model.new_request_cache()) for p in prompts]
    torch.testing.assert_close(first, torch.cat(alone_first), rtol=RTOL, atol=ATOL)


def test_bf16_prefill_and_decode_agree() -> None:
    # Every expert chosen (top-k = E): with sparse routing, bf16 rounding flips a few tokens'
    # expert choice between the two paths, which is an O(1) change for those tokens.
    dense_routing = {**CONFIG_A, "num_experts": 3, "num_experts_per_token": 3}
    model = make_model(dense_routing, seed=8, dtype=torch.bfloat16)
    ids = tokens(12, seed=4)
    full = model.prefill(ids, model.new_request_cache())
    cache = model.new_request_cache()
    steps = torch.cat([model.decode(ids[i : i + 1], [cache]) for i in range(12)])
    # Measured 3.6%. Random KDA layers amplify a relative input change ~3.5x (fp32, measured), so
    # bf16 rounding compounds over 8 random layers; a wrong state or cache row gives ~100%.
    rel = float((steps - full).norm() / full.norm())
    assert full.dtype == torch.float32 and rel < 0.1, rel


def test_positions_must_continue_the_cache(models: dict[str, KimiK3ForCausalLM]) -> None:
    model = models["A"]
    cache = model.new_request_cache()
    model.prefill(tokens(4, seed=5), cache)
    with pytest.raises(ValueError, match="continue its cache"):
        model(tokens(2, seed=6), torch.tensor([0, 1]), KimiK3Batch([2], [cache]))
    with pytest.raises(ValueError, match="do not sum"):
        model(tokens(2, seed=6), torch.tensor([4, 5]), KimiK3Batch([3], [cache]))


if __name__ == "__main__":
    run_this_file(__file__)
