"""An independent, cache-free fp32 Kimi K3 forward written from the design notes, the oracle of the
Kimi K3 model tests and of its parity sweep: the AttnRes bank and partial sums, transformers'
pure-torch chunked Kimi Linear KDA, naive NoPE MLA with the output gate, and the latent MoE with
SiTU written out one token and one expert at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.kimi_linear import modeling_kimi_linear as tf_kimi

from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_moe import KimiK3MoE

# fp32 everywhere; the forms differ only in summation order (chunked vs recurrent KDA, expanded vs
# absorbed MLA, one GEMM over a batch vs per request). The first KDA layer differs by ~4e-6
# (relative) and 8 random layers amplify that ~40x: measured max |diff| <= 2.3e-4 on logits of
# magnitude ~5. A plumbing error (wrong row, state, bank or norm) shows up at >= 1e-2.
RTOL, ATOL = 1e-3, 5e-4


# --- the MoE block ------------------------------------------------------------------------------


def situ_reference(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    """SiTU written out: a tanh soft-cap replaces SiLU's linear factor, and up is soft-capped."""
    return (
        beta
        * torch.tanh(gate / beta)
        * torch.sigmoid(gate)
        * (linear_beta * torch.tanh(up / linear_beta))
    )


def rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def mlp_reference(x: torch.Tensor, p: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    gate, up = x @ p[f"{prefix}.gate_proj.weight"].T, x @ p[f"{prefix}.up_proj.weight"].T
    return situ_reference(gate, up) @ p[f"{prefix}.down_proj.weight"].T


def moe_reference(moe: KimiK3MoE, x: torch.Tensor, *, rsf: float, eps: float) -> torch.Tensor:
    """fp32, one token and one expert at a time."""
    p = {n: t.detach().float() for n, t in moe.named_parameters()}
    assert moe.experts.weights is not None
    w13, w2 = (t.float() for t in (moe.experts.weights.w13, moe.experts.weights.w2))
    inter = w2.shape[2]
    k = moe.topk_config.top_k
    x = x.float()
    scores = torch.sigmoid(x @ p["gate.weight"].T)
    bias = p.get("gate.e_score_correction_bias", torch.zeros(scores.shape[1]))
    latent = "routed_expert_down_proj.weight" in p
    z = x @ p["routed_expert_down_proj.weight"].T if latent else x
    routed = torch.zeros(x.shape[0], z.shape[1])
    for t in range(x.shape[0]):
        chosen = sorted(range(scores.shape[1]), key=lambda e: -float(scores[t, e] + bias[e]))[:k]
        total = sum(float(scores[t, e]) for e in chosen)
        for e in chosen:
            h = w13[e] @ z[t]
            routed[t] += (
                float(scores[t, e])
                / (total + 1e-20)
                * rsf
                * (w2[e] @ situ_reference(h[:inter], h[inter:]))
            )
    if "routed_expert_norm.weight" in p:
        routed = rms_reference(routed, p["routed_expert_norm.weight"], eps)
    out = routed @ p["routed_expert_up_proj.weight"].T if latent else routed
    return out + mlp_reference(x, p, "shared_experts")


# --- the whole model ---------------------------------------------------------------------------


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
