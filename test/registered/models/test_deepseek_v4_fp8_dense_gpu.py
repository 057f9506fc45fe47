"""A DeepSeek V4 with FP8 dense layers on the GPU (skipped elsewhere): the built-in model's
architecture widened to 128-multiples where the FP8 GEMMs take their K, random weights quantised
to e4m3 with 128x128 block scales, ``quantization_config`` fp8, bf16, the Triton MoE runner.

- Loaded on CUDA, the FP8 layers stay FP8 and the resident bytes of its dense FP8 weights are the
  checkpoint's e4m3 bytes plus fp32 scales.
- Prefill logits (W8A8 on DeepGEMM where usable, else Triton; the grouped wo_a on Triton) are
  close to the fp32 model of the dequantised weights on the CPU, with and without the fused
  activation quantisers, and with Triton forced.
- Decode CUDA graphs: replay equals the same static decode run eagerly at the padded size, bit for
  bit, over steps that cross the window and the compressed blocks.
"""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.quant.fp8 import block_dequant_fp8, block_quant_weight_fp8
from sglang.srt.default_model.config import default_model_config
from sglang.srt.default_model.generate import random_weights
from sglang.srt.environ import envs
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.linear import LinearBase
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.loading import load_weights
from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file

register_cuda_ci(est_time=120, suite="h200-1gpu")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 512
FP8_SUFFIXES = (
    "attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight",
    "attn.wo_b.weight", "attn.indexer.wq_b.weight", "shared_experts.w1.weight",
    "shared_experts.w2.weight", "shared_experts.w3.weight",
)  # fmt: skip
T = 300  # crosses the window (32), the ratio-4 blocks and two ratio-128 blocks


@pytest.fixture(scope="module")
def checkpoint() -> tuple[dict, dict, dict]:
    """(config with quantization_config, FP8 tensors, the same tensors dequantised)."""
    raw = default_model_config(VOCAB, 0, 1)
    raw.update(q_lora_rank=128, o_lora_rank=128, moe_intermediate_size=128)
    # every expert routed and every compressed entry kept: activation rounding cannot flip a
    # discrete choice (a flipped top-k would dwarf the quantisation error being checked)
    raw.update(num_experts_per_tok=raw["n_routed_experts"], index_topk=4096)
    tensors = random_weights(raw, seed=7)
    quant, dequant = {}, {}
    for name, t in tensors.items():
        if name.endswith(FP8_SUFFIXES):
            q, s = block_quant_weight_fp8(t.float())
            quant[name], quant[name.removesuffix(".weight") + ".scale"] = q, s
            dequant[name] = block_dequant_fp8(q, s)
        else:
            quant[name] = dequant[name] = t
    config = dict(raw, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    return config, quant, dequant


def _model(config: dict, tensors: dict, dtype: torch.dtype, device: str) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict(config),
        LayerBuildSpec(
            dtype=dtype, device=device, moe_runner="triton" if device == "cuda" else "torch"
        ),
    )
    load_weights(model, tensors, LoadOptions(progress=False))
    return model.eval()


@pytest.fixture(scope="module")
def references(checkpoint) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Prefill logits on the CPU: the fp32 model of the dequantised weights, and the bf16 W8A8
    model (the torch reference of the GPU's maths)."""
    config, quant, dequant = checkpoint
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    ids, pos = _ids(T, 1).cpu(), torch.arange(T)
    fp32 = _model(plain, dequant, torch.float32, "cpu")(ids, pos)
    return fp32, _model(config, quant, torch.bfloat16, "cpu")(ids, pos)


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).cuda()


def test_fp8_layers_resident_as_shipped(checkpoint) -> None:  # type: ignore[no-untyped-def]
    config, quant, _ = checkpoint
    torch.cuda.synchronize()
    model = _model(config, quant, torch.bfloat16, "cuda")
    fp8 = [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase) and m.fp8]
    assert len(fp8) == len([k for k in quant if k.endswith(FP8_SUFFIXES)])
    resident = shipped = 0
    for name, layer in fp8:
        assert layer.weight.is_cuda and layer.weight.dtype == torch.float8_e4m3fn
        ckpt, scale = quant[f"{name}.weight"], quant[f"{name}.scale"]
        assert torch.equal(layer.weight.view(torch.uint8).cpu(), ckpt.view(torch.uint8))
        assert torch.equal(layer.weight_scale_inv.cpu(), scale)
        resident += layer.weight.nbytes + layer.weight_scale_inv.nbytes
        shipped += ckpt.numel() + 4 * scale.numel()
    assert resident == shipped


@pytest.mark.parametrize(("knob", "fused"), [("auto", False), ("auto", True), ("triton", False)])
def test_prefill_logits_match_the_cpu_w8a8_and_stay_near_fp32(
    checkpoint, references, knob: str, fused: bool
) -> None:  # type: ignore[no-untyped-def]
    config, quant, _ = checkpoint
    fp32, cpu_w8a8 = references
    with envs.SGLANG_FP8_DENSE_GEMM.override(knob), envs.SGLANG_FP8_FUSED_ACT_QUANT.override(fused):
        model = _model(config, quant, torch.bfloat16, "cuda")
        got = model(_ids(T, 1), torch.arange(T, device="cuda")).cpu()

    def rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
        d = (a - b).abs()
        return float(d.max() / b.abs().max()), float(d.mean() / b.abs().mean())

    same_maths, quantised = rel(got, cpu_w8a8), rel(got, fp32)
    print(
        f"{knob} fused={fused}: vs CPU W8A8 rel max/mean {same_maths[0]:.3e}/{same_maths[1]:.3e}; "
        f"vs fp32 {quantised[0]:.3e}/{quantised[1]:.3e} (CPU W8A8 vs fp32: "
        f"{rel(cpu_w8a8, fp32)[0]:.3e})"
    )
    # The same W8A8 maths: only fp32 summation orders (and so rare FP8 rounding flips) differ.
    assert same_maths[0] < 0.15 and same_maths[1] < 0.05
    # e4m3 activations through 4 layers of random weights: ~2.6% a GEMM, compounded.
    assert quantised[0] < 0.4 and quantised[1] < 0.25


@pytest.mark.parametrize("knob", ["auto", "triton"])
def test_decode_graph_replay_equals_the_static_decode(checkpoint, knob: str) -> None:  # type: ignore[no-untyped-def]
    config, quant, _ = checkpoint
    with envs.SGLANG_FP8_DENSE_GEMM.override(knob), envs.SGLANG_FP8_FUSED_ACT_QUANT.override(True):
        model = _model(config, quant, torch.bfloat16, "cuda")
        model.enable_slot_pool(max_slots=8, capacity=512, block_tokens=128)
        graphs = CudaGraphRunner(model, [1, 2, 4], torch.device("cuda"))
        graphs.capture()
        lengths, steps = (5, 100, 230), 40
        seqs = [_ids(n + steps, seed=10 + i) for i, n in enumerate(lengths)]
        replayed = [model.new_pooled_cache() for _ in lengths]
        static = [model.new_pooled_cache() for _ in lengths]
        for seq, n, a, b in zip(seqs, lengths, replayed, static):
            model.prefill(seq[:n], a)
            model.prefill(seq[:n], b)
        size = graphs.padded_size(len(lengths))
        for t in range(steps):
            ids = torch.stack([seq[n + t] for seq, n in zip(seqs, lengths)])
            got = model.decode_pooled(ids, replayed, step=graphs.replay).clone()
            want = model.decode_pooled(ids, static, pad_to=size)
            assert torch.equal(got, want), (knob, t, float((got - want).abs().max()))


if __name__ == "__main__":
    run_this_file(__file__)
