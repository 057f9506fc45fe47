"""The resident-weights report: groups and formats read from names and dtypes, each storage
counted once (tied tables, a MegaMoE layout shared with the runner), FP8 scales counted with their
weights, the routed experts of every ``FusedMoE``; the comparison with the checkpoint share; the
memory budget's line; and ``check_env``'s expert table."""

from __future__ import annotations

import torch
from torch import nn

from sglang.check_env import expert_plan_lines
from sglang.srt.layers.moe.expert_plan import B200, CPU, H200
from sglang.srt.layers.moe.expert_weights import ExpertWeights, mxfp4_experts
from sglang.srt.layers.moe.layer import FusedMoE, FusedMoEConfig
from sglang.srt.mem_cache.memory_models.weight_bytes import (
    WeightBytes,
    human_bytes,
    resident_vs_checkpoint,
)
from sglang.srt.model_executor.memory_budget import weights_note
from sglang.srt.model_loader.resident_weights import (
    layer_of,
    resident_weight_bytes,
    weight_group,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)


def test_names_map_to_groups_and_layers() -> None:
    cases = {
        "layers.3.attn.wq_a.weight": ("attention", 3),
        "model.layers.4.self_attn.q_proj.weight": ("attention", 4),
        "layers.1.ffn.shared_experts.w1.weight": ("shared_experts", 1),
        "model.layers.2.mlp.experts": ("routed_experts", 2),
        "layers.0.ffn.experts.experts": ("routed_experts", 0),
        "model.layers.2.mlp.routed_expert_down_proj.weight": ("other", 2),
        "layers.0.ffn.gate.weight": ("other", 0),
        "layers.0.attn_norm.weight": ("other", 0),
        "embed.weight": ("embeddings_head", None),
        "lm_head.weight": ("embeddings_head", None),
        "model.embed_tokens.weight": ("embeddings_head", None),
        "hc_head_fn": ("other", None),
    }
    for name, (group, layer) in cases.items():
        assert (weight_group(name), layer_of(name)) == (group, layer), name


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Parameter(torch.zeros(256, 128, dtype=torch.float8_e4m3fn), False)
        self.register_buffer("wq_scale", torch.ones(2, 1))  # fp32 beside an FP8 weight


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attn()
        self.attn_norm = nn.Parameter(torch.ones(128))
        self.ffn = nn.Module()
        self.ffn.experts = FusedMoE(
            FusedMoEConfig(4, 128, 64, 2, runner="torch", a2a_backend="megamoe")
        )


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 128).to(torch.bfloat16)
        self.head = nn.Linear(128, 32, bias=False).to(torch.bfloat16)
        self.head.weight = self.embed.weight  # tied: one storage
        self.layers = nn.ModuleList([_Layer(), _Layer()])


def _mxfp4(seed: int) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randint(0, 255, shape, dtype=torch.uint8, generator=gen)

    return mxfp4_experts(r(4, 128, 64), r(4, 128, 32), r(4, 128, 4), r(4, 128, 2))


def test_the_walk_counts_every_storage_once_by_group_and_format() -> None:
    model = _Model()
    for i, layer in enumerate(model.layers):
        layer.ffn.experts.load_local_weights(_mxfp4(i))
    report = resident_weight_bytes(model)
    expert_bytes = 4 * (128 * 64 + 128 * 32 + 128 * 4 + 128 * 2)
    assert report.entries == {
        (None, "embeddings_head", "bf16"): 32 * 128 * 2,  # tied: once
        (0, "attention", "fp8"): 256 * 128 + 2 * 4,  # the fp32 scale counts as FP8
        (1, "attention", "fp8"): 256 * 128 + 2 * 4,
        (0, "other", "fp32"): 128 * 4,
        (1, "other", "fp32"): 128 * 4,
        (0, "routed_experts", "mxfp4"): expert_bytes,
        (1, "routed_experts", "mxfp4"): expert_bytes,
    }
    # MegaMoE weights set beside the runner's are counted too (they are resident), placeholders
    # are not
    model.layers[0].ffn.experts.set_mega_weights(("placeholder", 1))  # type: ignore[arg-type]
    assert resident_weight_bytes(model).total() == report.total()
    extra = torch.zeros(100, dtype=torch.int8)
    model.layers[0].ffn.experts.set_mega_weights(((extra, extra), (extra, extra)))  # type: ignore[arg-type]
    grown = resident_weight_bytes(model)
    assert grown.entries[(0, "routed_experts", "mega beside")] == 100


def test_bytes_compare_per_layer_and_for_the_whole_model() -> None:
    routed = "routed_experts"
    resident = WeightBytes.of(
        [(0, routed, "mxfp4", 100), (1, routed, "fp8", 200), (None, "other", "bf16", 50)]
    )
    ckpt = WeightBytes.of(
        [(0, routed, "mxfp4", 100), (1, routed, "mxfp4", 100), (None, "other", "fp32", 100)]
    )
    rows = resident_vs_checkpoint(resident, ckpt)
    assert [(r.layer, r.ratio) for r in rows] == [(0, 1.0), (1, 2.0), (None, 350 / 300)]
    assert resident.by_format() == {"fp8": 200, "mxfp4": 100, "bf16": 50}
    assert resident.only("other").total() == 50 and (resident + ckpt).total() == 650
    assert "routed_experts fp8 200 B" in resident.describe()
    assert human_bytes(3 << 30) == "3.00 GiB" and human_bytes(1536) == "1.50 KiB"
    note = weights_note(resident, in_use_bytes=1000)
    assert "weights resident 350 B (fp8 200 B, mxfp4 100 B, bf16 50 B)" in note
    assert "650 B more in use" in note


def test_check_env_prints_the_expert_table_for_a_device() -> None:
    h200 = "\n".join(expert_plan_lines(H200))
    assert (
        "mxfp4 experts, --moe-a2a-backend none, DeepSeek V4: mxfp4 experts kept mxfp4; "
        "--moe-runner-backend triton: fused_experts_mxfp4" in h200
    )
    assert (
        "mxfp4 experts, --moe-a2a-backend megamoe, DeepSeek V4: mxfp4 experts kept fp8 in "
        "DeepGEMM's MegaMoE layout, converted from MXFP4 at load; MegaMoE kernel fp8_mega_moe"
    ) in h200
    assert "mxfp4 experts, --moe-a2a-backend megamoe, Kimi K3: mxfp4 experts kept mxfp4;" in h200
    b200 = "\n".join(expert_plan_lines(B200))
    assert "Kimi K3: mxfp4 experts kept mxfp4 in DeepGEMM's MegaMoE layout" in b200
    cpu = expert_plan_lines(CPU, torch.float32)
    assert len(cpu) == 3 * 2 * 2
    assert any("mxfp4 experts kept float32, dequantised at load" in line for line in cpu)


if __name__ == "__main__":
    run_this_file(__file__)
