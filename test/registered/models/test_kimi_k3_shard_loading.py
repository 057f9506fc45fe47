"""Kimi K3's routed experts are cut to this rank's part *as stored* (packed MXFP4 bytes and UE8M0
scales) and only that part is dequantised: the loaded weights are bit-identical to dequantising
the whole stacked tensor and then sharding (the previous behaviour), for tensor-parallel slices
expert-parallel (MegaMoE) ranks and ranks of ``--tp-size 4 --ep-size 2`` (half the experts, half
of each) alike, and the dequantiser never sees more than one rank's part."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe import expert_weights as expert_weights_mod
from sglang.srt.layers.moe.expert_weights import expert_weights_from_checkpoint
from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.model_loader.checkpoint_index import CheckpointIndex, WeightLoadError
from sglang.srt.model_loader.expert_loading import read_experts
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.model_loader.weight_source import as_weight_source
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_checkpoint import canonical_name
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.srt.models.loading import load_weights
from sglang.test.ci_register import register_cpu_ci
from sglang.test.kimi_k3_tiny import CONFIG_A, CONFIG_MEGA, config, make_model
from sglang.test.release_checkpoint import kimi_k3 as k3_release
from sglang.test.run import run_this_file

register_cpu_ci(est_time=10)

# (rank, tp size, a2a backend, ep size)
LAYOUTS = [
    (0, 1, "none", 1),
    (0, 2, "none", 1),
    (1, 2, "none", 1),
    (1, 2, "megamoe", 2),
    (3, 4, "ep", 2),
]


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, dict[str, torch.Tensor]]:
    src = make_model(CONFIG_MEGA, seed=11)
    return {
        "mxfp4": dict(k3_release.model_release_tensors(src).tensors),
        "bf16": dict(k3_release.model_release_tensors(src, experts="bf16").tensors),
    }


def _previous_way(ckpt: dict[str, torch.Tensor], layer_id: int, experts: FusedMoE) -> FusedMoE:
    """Dequantise the full stacked tensors, then let FusedMoE keep this rank's part."""
    index, _ = CheckpointIndex.build(as_weight_source(ckpt), canonical_name)
    c = experts.config
    full = read_experts(
        index,
        f"model.layers.{layer_id}.mlp.experts",
        layer_id=layer_id,
        num_experts=c.num_experts,
        hidden=c.hidden_size,
        inter=c.intermediate_size,
        scale_suffixes=lambda f: (".weight_scale",),
    )
    ref = FusedMoE(c, tp_rank=experts.tp_rank, tp_size=experts.tp_size)  # c carries the ep size
    ref.load_weights(
        expert_weights_from_checkpoint(
            full.fmt, full.w13, full.w2, full.w13_scale, full.w2_scale, dtype=torch.float32
        )
    )
    return ref


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
@pytest.mark.parametrize(
    ("rank", "size", "a2a", "ep"),
    LAYOUTS,
    ids=["tp1", "tp2-r0", "tp2-r1", "ep2-r1", "tp4-ep2-r3"],
)
def test_shard_first_equals_dequantise_then_shard(
    checkpoints: dict[str, dict[str, torch.Tensor]],
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
    rank: int,
    size: int,
    a2a: str,
    ep: int,
) -> None:
    ckpt = checkpoints[fmt]
    seen: list[tuple[int, ...]] = []
    real = expert_weights_mod.dequant_mxfp4

    def spy(
        packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        seen.append(tuple(packed.shape))
        return real(packed, scales, dtype)

    monkeypatch.setattr(expert_weights_mod, "dequant_mxfp4", spy)
    model = KimiK3ForCausalLM(
        config(CONFIG_MEGA),
        LayerBuildSpec(
            dtype=torch.float32,
            moe_runner="torch",
            tp_rank=rank,
            tp_size=size,
            a2a_backend=a2a,
            moe_ep_size=ep,
        ),
    )
    load_weights(model, ckpt, LoadOptions(progress=False))
    monkeypatch.setattr(expert_weights_mod, "dequant_mxfp4", real)

    moe_layers = [
        (i, layer.mlp)
        for i, layer in enumerate(model.decoder_layers)
        if isinstance(layer.mlp, KimiK3MoE)
    ]
    e_local, i_local = 8 // ep, 128 // (size // ep)
    h = CONFIG_MEGA["routed_expert_hidden_size"]
    if fmt == "mxfp4":
        # only this rank's part ever reaches the dequantiser: w13 then w2, once a layer
        assert seen == [(e_local, 2 * i_local, h // 2), (e_local, h, i_local // 2)] * len(
            moe_layers
        )
    else:
        assert seen == []
    for i, moe in moe_layers:
        got, want = moe.experts.weights, _previous_way(ckpt, i, moe.experts).weights
        assert got is not None and want is not None
        assert torch.equal(got.w13, want.w13) and torch.equal(got.w2, want.w2)
        assert got.w13.shape == (e_local, 2 * i_local, h)


def test_mxfp4_slice_must_cover_whole_scale_groups() -> None:
    # intermediate 32 over 2 ranks: 16 columns of w2 a rank, half a 32-value scale group
    ckpt = dict(k3_release.model_release_tensors(make_model(CONFIG_A, seed=1)).tensors)
    model = KimiK3ForCausalLM(
        config(CONFIG_A),
        LayerBuildSpec(dtype=torch.float32, moe_runner="torch", tp_rank=1, tp_size=2),
    )
    with pytest.raises(
        WeightLoadError,
        match=r"mxfp4 experts need this rank's intermediate slice \(16 of 32\) divisible by 32",
    ):
        load_weights(model, ckpt, LoadOptions(progress=False))


if __name__ == "__main__":
    run_this_file(__file__)
