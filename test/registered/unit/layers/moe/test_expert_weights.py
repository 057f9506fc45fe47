"""Expert weights from bf16, FP8 (128x128 blocks) and MXFP4 checkpoints, and their TP shards."""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.quant.fp8 import block_quant_weight_fp8
from sglang.srt.layers.moe.expert_weights import (
    ExpertWeights,
    WeightFormat,
    expert_weights_from_checkpoint,
    stack_expert_tensors,
)
from sglang.srt.layers.quantization.mxfp4 import dequant_mxfp4, quant_mxfp4
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=5)

E, H, I = 3, 256, 256
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_mxfp4_decodes_bytes_as_documented() -> None:
    # byte 0x9A: low nibble 0xA = -1.0 (sign + code 2), high nibble 0x9 = -0.5; scale 128 -> x2.
    packed = torch.tensor([[0x9A, 0x07] * 16], dtype=torch.uint8)  # 64 values
    scales = torch.tensor([[128, 125]], dtype=torch.uint8)
    out = dequant_mxfp4(packed, scales, torch.float32)[0]
    assert out[:4].tolist() == [-2.0, -1.0, 12.0, 0.0]
    assert out[32:36].tolist() == [-0.25, -0.125, 1.5, 0.0]


def test_mxfp4_against_independent_decoder() -> None:
    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 134, (4, 1), dtype=torch.uint8, generator=gen)
    got = dequant_mxfp4(packed, scales, torch.float32)
    for r in range(4):
        for j in range(16):
            byte = int(packed[r, j])
            for half, nib in ((0, byte & 15), (1, byte >> 4)):
                value = (-1 if nib & 8 else 1) * E2M1[nib & 7] * 2.0 ** (int(scales[r, 0]) - 127)
                assert float(got[r, 2 * j + half]) == value


def test_mxfp4_round_trip_and_shape_error() -> None:
    w = _rand(4, 64, seed=1)
    packed, scales = quant_mxfp4(w)
    back = dequant_mxfp4(packed, scales, torch.float32)
    # E2M1 has at most 25% relative spacing near the group max; errors stay within half a step.
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert ((back - w).abs() <= step * 1.0 + 1e-6).all()
    assert (back != 0).float().mean() > 0.5
    with pytest.raises(ValueError, match="MXFP4 scales of shape"):
        dequant_mxfp4(packed, scales[:, :1])


def test_bf16_fp8_mxfp4_checkpoints_give_the_same_weights() -> None:
    w13, w2 = _rand(E, 2 * I, H, seed=2) * 0.1, _rand(E, H, I, seed=3) * 0.1
    bf16 = expert_weights_from_checkpoint("bf16", w13, w2)
    assert bf16.w13.dtype == torch.bfloat16 and not bf16.is_fp8

    q13, s13 = block_quant_weight_fp8(w13, (128, 128))
    q2, s2 = block_quant_weight_fp8(w2, (128, 128))
    fp8 = expert_weights_from_checkpoint(WeightFormat.FP8, q13, q2, s13, s2)
    assert fp8.is_fp8 and fp8.block_shape == (128, 128)
    d13, d2 = fp8.dequantized(torch.float32)
    assert (d13 - w13).norm() / w13.norm() < 0.05 and (d2 - w2).norm() / w2.norm() < 0.05

    p13, ms13 = quant_mxfp4(w13)
    p2, ms2 = quant_mxfp4(w2)
    mx = expert_weights_from_checkpoint("mxfp4", p13, p2, ms13, ms2)
    assert mx.w13.dtype == torch.bfloat16 and mx.w13.shape == (E, 2 * I, H)
    assert (mx.w13.float() - w13).norm() / w13.norm() < 0.2
    assert torch.equal(mx.w13, dequant_mxfp4(p13, ms13))

    with pytest.raises(ValueError, match="need their UE8M0 scales"):
        expert_weights_from_checkpoint("mxfp4", p13, p2)
    with pytest.raises(ValueError, match="needs block scales"):
        expert_weights_from_checkpoint("fp8", q13, q2, s13[:, :1], s2)
    with pytest.raises(ValueError, match="expert weights disagree"):
        ExpertWeights(w13, w2[:, :, :8])


@pytest.mark.parametrize("fp8", [False, True])
def test_tp_shards_reassemble_the_full_weights(fp8: bool) -> None:
    inter = 512
    w13, w2 = _rand(E, 2 * inter, H, seed=4), _rand(E, H, inter, seed=5)
    full = ExpertWeights(w13, w2)
    if fp8:
        q13, s13 = block_quant_weight_fp8(w13, (128, 128))
        q2, s2 = block_quant_weight_fp8(w2, (128, 128))
        full = ExpertWeights(q13, q2, s13, s2)
    parts = [full.shard(r, 2) for r in range(2)]
    gates = torch.cat([p.dequantized(torch.float32)[0][:, : inter // 2] for p in parts], dim=1)
    ups = torch.cat([p.dequantized(torch.float32)[0][:, inter // 2 :] for p in parts], dim=1)
    downs = torch.cat([p.dequantized(torch.float32)[1] for p in parts], dim=2)
    ref13, ref2 = full.dequantized(torch.float32)
    assert torch.equal(gates, ref13[:, :inter]) and torch.equal(ups, ref13[:, inter:])
    assert torch.equal(downs, ref2)
    if fp8:
        with pytest.raises(ValueError, match="divisible by 128"):
            full.shard(0, 8)


def test_stack_expert_tensors() -> None:
    gate = [_rand(I, H, seed=10 + e) for e in range(E)]
    up = [_rand(I, H, seed=20 + e) for e in range(E)]
    down = [_rand(H, I, seed=30 + e) for e in range(E)]
    w13, w2 = stack_expert_tensors(gate, up, down)
    assert (
        torch.equal(w13[1, :I], gate[1])
        and torch.equal(w13[2, I:], up[2])
        and torch.equal(w2[0], down[0])
    )
    with pytest.raises(ValueError, match="same non-zero number"):
        stack_expert_tensors(gate, up[:1], down)


if __name__ == "__main__":
    run_this_file(__file__)
