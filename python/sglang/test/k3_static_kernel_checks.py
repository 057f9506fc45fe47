"""Kimi K3's static decode steps through the Triton kernels against their torch paths, on pooled
states addressed by slot (what the decode CUDA graphs run), shared by the interpreter test
(``test/registered/models/test_kimi_k3_static_kernels.py``: CPU tensors under
``TRITON_INTERPRET=1``) and the GPU graph test. Fresh random states, latents and weights.

- KDA: the kernels' pointer table computed on the device as ``base + slot * stride``, two padding
  rows on the scratch slot: the real rows' outputs and states equal the torch step's (fp32, 1e-5:
  summation orders apart), the conv shift bit-identical, slots outside the batch untouched.
- MLA: the absorbed kernel over each slot's whole table row with device lengths (positions + 1)
  against the torch pass over every row, bf16 latents: the written latents bit-identical, the
  outputs to bf16 rounding (relative Frobenius error < 1e-2: both round the same fp32 maths).
"""

from __future__ import annotations

import torch

from sglang.srt.layers.attention.kda import KDAConfig, KimiDeltaAttention
from sglang.srt.layers.attention.kda_static_decode import (
    kda_static_decode,
    kda_static_decode_torch,
    static_kernel_reason,
)
from sglang.srt.layers.attention.mla_nope import MLANoPEAttention, MLANoPEConfig
from sglang.srt.layers.attention.mla_static_decode import mla_static_decode
from sglang.srt.layers.attention.mla_static_decode import static_kernel_reason as mla_reason
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.test.random_params import randomize_params_


def check_kda_static(dev: str) -> None:
    cfg = KDAConfig(64, 2, 16, 4, gate_lower_bound=-5.0, full_rank_gate=True)
    layer = KimiDeltaAttention(cfg, LayerBuildSpec(dtype=torch.float32, device=dev))
    randomize_params_(layer, torch.Generator(dev).manual_seed(2), vector_scale=0.5)
    gen = torch.Generator(dev).manual_seed(3)
    slots_total, scratch = 5, 4
    conv = torch.randn(slots_total, 3, 3 * layer.local_width, generator=gen, device=dev)
    rec = torch.randn(slots_total, 2, 16, 16, generator=gen, device=dev) * 0.3
    x = torch.randn(4, 64, generator=gen, device=dev)
    slots = torch.tensor([3, 0, scratch, scratch], device=dev)
    mixed = torch.zeros(1, 3 * layer.local_width, device=dev)
    assert static_kernel_reason(mixed, layer.conv_weight(), conv, rec, 16) is None
    conv_ref, rec_ref = conv.clone(), rec.clone()
    with torch.no_grad():
        got = kda_static_decode(layer, x, slots, conv, rec)
        want = kda_static_decode_torch(layer, x, slots, conv_ref, rec_ref)
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-5, atol=1e-5)
    for s in (3, 0):
        assert torch.equal(conv[s], conv_ref[s])
        torch.testing.assert_close(rec[s], rec_ref[s], rtol=1e-5, atol=1e-5)
    for s in (1, 2):  # not in the batch: the padding rows wrote only the scratch slot
        assert torch.equal(conv[s], conv_ref[s]) and torch.equal(rec[s], rec_ref[s])


def check_mla_static(dev: str) -> None:
    cfg = MLANoPEConfig(
        hidden_size=64,
        num_heads=2,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        rms_norm_eps=1e-5,
    )
    layer = MLANoPEAttention(cfg, LayerBuildSpec(dtype=torch.bfloat16, device=dev))
    randomize_params_(layer, torch.Generator(dev).manual_seed(4), vector_scale=0.5)
    gen = torch.Generator(dev).manual_seed(5)
    null = 6  # blocks 0..5, the null block last
    store = torch.randn(null + 1, 8, 48, generator=gen, device=dev).to(torch.bfloat16)
    table = torch.tensor([[2, 5, null], [0, null, null], [1, 3, 4], [null] * 3], device=dev)
    slots = torch.tensor([0, 1, 2, 3, 3], device=dev)  # slot 3: scratch, two padding rows
    positions = torch.tensor([12, 3, 20, 0, 0], device=dev)
    x = torch.randn(5, 64, generator=gen, device=dev).to(torch.bfloat16)
    assert mla_reason(layer, store) is None
    ref = store.clone()
    with torch.no_grad():
        got = mla_static_decode(layer, x, positions, slots, store, table)
        layer.decode_kernel = False
        assert mla_reason(layer, ref) is not None
        want = mla_static_decode(layer, x, positions, slots, ref, table)
        layer.decode_kernel = True
    assert torch.equal(store, ref)
    rel = float((got[:3].float() - want[:3].float()).norm() / want[:3].float().norm())
    assert rel < 1e-2, rel


def run_all(dev: str) -> None:
    check_kda_static(dev)
    check_mla_static(dev)
