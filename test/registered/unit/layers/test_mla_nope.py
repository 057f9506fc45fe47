"""Kimi K3's NoPE MLA layer against transformers' ``KimiLinearAttention`` (NoPE MLA, every
parameter random): prefill (latents expanded to per-head K/V) and cached decode (``kv_b`` absorbed
into the query and output) both match, with and without q LoRA; the output gate multiplies by
``sigmoid(g_proj(x))`` before ``o_proj``; the cache holds one ``[c_kv | k_pe]`` row a token."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

from sglang.srt.layers.attention.mla_nope import MLANoPEAttention, MLANoPEConfig, MLASegment
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.mem_cache.growable_rows import GrowableRows
from sglang.srt.mem_cache.kimi_k3_cache import MLALatentCache
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)

logging.getLogger("transformers").setLevel(logging.ERROR)

H, HEADS, KV_LORA, NOPE, ROPE, V = 48, 3, 32, 16, 8, 12
# transformers builds q_a_layernorm / kv_a_layernorm with its RMSNorm default eps
EPS = 1e-6


def _pair(q_lora: int | None, gate: bool, seed: int) -> tuple[nn.Module, MLANoPEAttention]:
    cfg = KimiLinearConfig(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        num_hidden_layers=1,
    )
    cfg._attn_implementation = "eager"
    tf = KimiLinearAttention(cfg, 0).eval()
    ours = MLANoPEAttention(
        MLANoPEConfig(H, HEADS, q_lora, KV_LORA, NOPE, ROPE, V, EPS, output_gate=gate),
        LayerBuildSpec(dtype=torch.float32),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tf.named_parameters():
            scale = 1.0 if "layernorm" in name else p.shape[-1] ** -0.5
            p.copy_(
                torch.randn(p.shape, generator=g) * scale + (1.0 if "layernorm" in name else 0.0)
            )
        ours.load_state_dict(tf.state_dict(), strict=False)
        if ours.g_proj is not None:
            ours.g_proj.weight.copy_(torch.randn(ours.g_proj.weight.shape, generator=g) * H**-0.5)
    return tf, ours


def _tf_forward(tf: nn.Module, x: torch.Tensor) -> torch.Tensor:
    t = x.shape[0]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return tf(x[None], attention_mask=mask)[0][0]


def _cache() -> MLALatentCache:
    return MLALatentCache(GrowableRows(KV_LORA + ROPE, dtype=torch.float32))


@pytest.mark.parametrize("q_lora", [None, 20], ids=["q_proj", "q_lora"])
def test_prefill_and_absorbed_decode_match_transformers(q_lora: int | None) -> None:
    tf, ours = _pair(q_lora, gate=False, seed=1)
    x = torch.randn(17, H, generator=torch.Generator().manual_seed(2))
    want = _tf_forward(tf, x)
    with torch.no_grad():
        got = ours(x, [MLASegment(0, 17, _cache())])
        cache = _cache()
        ours(x[:10], [MLASegment(0, 10, cache)])
        steps = [ours(x[i : i + 1], [MLASegment(0, 1, cache)]) for i in range(10, 17)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps), want[10:], rtol=1e-5, atol=1e-5)
    assert len(cache) == 17 and cache.rows.rows().shape == (17, KV_LORA + ROPE)
    torch.testing.assert_close(cache.rows.rows(), ours.latents(x))


def test_output_gate_is_a_sigmoid_before_o_proj() -> None:
    _, gated = _pair(20, gate=True, seed=3)
    _, plain = _pair(20, gate=False, seed=3)
    assert gated.g_proj is not None
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(4))
    captured: list[torch.Tensor] = []
    plain.o_proj.register_forward_hook(lambda m, i, o: captured.append(i[0]))
    with torch.no_grad():
        plain(x, [MLASegment(0, 6, _cache())])
        want = gated.o_proj(captured[0] * torch.sigmoid(gated.g_proj(x)))
        got = gated(x, [MLASegment(0, 6, _cache())])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


if __name__ == "__main__":
    run_this_file(__file__)
