"""Loading Kimi K3 checkpoints: the released naming (``language_model.model.layers.N``,
``block_sparse_moe``), 1-based layer lists, MXFP4 routed experts (``weight_packed`` +
``weight_scale``), fp32 KDA tensors (``A_log`` as the release's ``[head_dim]`` vector), vision
tensors skipped, clear errors naming missing / mis-shaped / mistyped / unexpected tensors, a
round trip through safetensors on disk, and tensor parallelism: TP=2 over gloo equals TP=1 (normal
path and the MegaMoE layout's fallback), prefill + decode included."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_loader.checkpoint_index import WeightLoadError
from sglang.srt.model_loader.load_options import LoadOptions
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_checkpoint import canonical_name
from sglang.srt.models.kimi_k3_config import ConfigError, KimiK3Config
from sglang.srt.models.kimi_k3_moe import KimiK3MoE
from sglang.srt.models.loading import load_model, load_weights
from sglang.test.ci_register import register_cpu_ci
from sglang.test.kimi_k3_tiny import CONFIG_A, CONFIG_B, config, make_model, tokens
from sglang.test.multiprocess import run_distributed
from sglang.test.release_checkpoint import kimi_k3 as release
from sglang.test.release_checkpoint.emit import ReleaseTensors
from sglang.test.run import run_this_file

register_cpu_ci(est_time=10)


def _fresh(raw: dict[str, Any], **kw: Any) -> KimiK3ForCausalLM:
    return KimiK3ForCausalLM(
        config(raw), LayerBuildSpec(dtype=torch.float32, moe_runner="torch", **kw)
    )


def _from_values(raw: dict[str, Any], values: Mapping[str, torch.Tensor]) -> KimiK3ForCausalLM:
    """A model built from the values a release checkpoint stands for (experts dequantised)."""
    model = _fresh(raw)
    load_weights(model, values, LoadOptions(progress=False))
    return model.eval()


# --- names and config ---------------------------------------------------------------------------


def test_checkpoint_names_map_to_model_names() -> None:
    assert canonical_name(
        "language_model.model.layers.3.block_sparse_moe.experts.7.w1.weight_packed"
    ) == ("model.layers.3.mlp.experts.7.w1.weight")
    assert canonical_name(
        "language_model.model.layers.3.block_sparse_moe.experts.7.w1.weight_scale"
    ) == ("model.layers.3.mlp.experts.7.w1.weight_scale")
    assert (
        canonical_name("language_model.layers.2.self_attn.q_conv1d.weight")
        == "model.layers.2.self_attn.q_conv1d.weight"
    )
    assert canonical_name("language_model.lm_head.weight") == "lm_head.weight"
    assert (
        canonical_name("model.layers.0.self_attn.forget_gate.A_log")
        == "model.layers.0.self_attn.A_log"
    )
    assert canonical_name("embed_tokens.weight") == "model.embed_tokens.weight"
    assert canonical_name("vision_tower.encoder.blocks.0.wqkv.weight") is None
    assert canonical_name("mm_projector.proj.0.weight") is None


def test_release_schedule_is_one_based() -> None:
    mla = [*range(4, 93, 4), 93]
    raw = {
        **CONFIG_A,
        "num_hidden_layers": 93,
        "linear_attn_config": {
            **CONFIG_A["linear_attn_config"],
            "full_attn_layers": mla,
            "kda_layers": [i for i in range(1, 94) if i not in mla],
        },
    }
    c = KimiK3Config.from_dict(
        {
            "model_type": "kimi_k3",
            "text_config": raw,
            "quantization_config": {"format": "mxfp4-pack-quantized"},
        }
    )
    assert [i for i in range(93) if not c.is_kda(i)] == [*range(3, 92, 4), 92] and len(mla) == 24
    assert c.layer_kinds[91:] == ("mla", "mla") and c.expert_quant_format == "mxfp4"


@pytest.mark.parametrize(
    "lin,match",
    [
        (
            {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4]},
            r"\[8\] \(1-based\) are in neither",
        ),
        ({"kda_layers": [0, 1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]}, "outside 1..8"),
        ({"kda_layers": [1, 2, 3, 4, 5, 6, 7], "full_attn_layers": [4, 8]}, "appears twice"),
        ({"kda_layers": [1, 2, 3], "full_attn_layers": None}, "needs both"),
    ],
)
def test_bad_layer_lists_are_rejected(lin: dict[str, Any], match: str) -> None:
    merged = {k: v for k, v in {**CONFIG_A["linear_attn_config"], **lin}.items() if v is not None}
    with pytest.raises(ConfigError, match=match):
        config({**CONFIG_A, "linear_attn_config": merged})


def test_other_situ_constants_are_rejected() -> None:
    with pytest.raises(ConfigError, match="linear_beta"):
        config({**CONFIG_A, "activation_situ_linear_beta": 10.0})


# --- loading ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint() -> ReleaseTensors:
    """CONFIG_A's random model in the release's tensors (MXFP4 experts, vision tensors)."""
    return release.model_release_tensors(make_model(CONFIG_A, seed=3), vision=True)


@pytest.fixture(scope="module")
def source_model(checkpoint: ReleaseTensors) -> KimiK3ForCausalLM:
    return _from_values(CONFIG_A, checkpoint.values)  # experts as the MXFP4 checkpoint holds them


def test_released_naming_with_mxfp4_experts_loads_exactly(
    checkpoint: ReleaseTensors, source_model: KimiK3ForCausalLM, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = checkpoint.tensors
    assert sum(n.startswith(("vision_tower.", "mm_projector.")) for n in ckpt) == 2
    model = _fresh(CONFIG_A)
    logging.getLogger("sglang").propagate = True
    with caplog.at_level(logging.INFO, logger="sglang"):
        load_weights(model, ckpt, LoadOptions(progress=False))
    assert any("skipping 2 vision" in r.getMessage() for r in caplog.records)
    attn = model.decoder_layers[0].self_attn
    for p in (attn.A_log, attn.dt_bias, attn.q_conv1d.weight, attn.o_norm.weight):  # type: ignore[union-attr]
        assert p.dtype == torch.float32
    torch.testing.assert_close(attn.A_log, source_model.decoder_layers[0].self_attn.A_log)  # type: ignore[union-attr]
    ids = tokens(15, seed=4)
    torch.testing.assert_close(
        model(ids, torch.arange(15)), source_model(ids, torch.arange(15)), rtol=0, atol=0
    )


def test_errors_name_the_tensor(checkpoint: ReleaseTensors) -> None:
    ckpt = checkpoint.tensors

    def load(edit: dict[str, torch.Tensor | None], **kw: Any) -> None:
        bad = dict(ckpt)
        for k, v in edit.items():
            if v is None:
                del bad[k]
            else:
                bad[k] = v
        load_weights(_fresh(CONFIG_A), bad, LoadOptions(progress=False, **kw))

    q = "language_model.model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(
        WeightLoadError, match=r"missing 1 tensor.*model\.layers\.1\.self_attn\.q_proj\.weight"
    ):
        load({q: None})
    with pytest.raises(WeightLoadError, match=rf"{q}.*expected shape \(32, 64\), got \(32, 63\)"):
        load({q: torch.zeros(32, 63)})
    with pytest.raises(WeightLoadError, match=rf"{q}.*only the routed experts may be quantised"):
        load({q: torch.zeros(32, 64, dtype=torch.uint8)})
    conv = "language_model.model.layers.0.self_attn.k_conv1d.weight"
    with pytest.raises(WeightLoadError, match=rf"{conv}.*expected shape \(32, 1, 4\)"):
        load({conv: torch.zeros(32, 4)})
    e = "language_model.model.layers.2.block_sparse_moe.experts.5.w2"
    with pytest.raises(
        WeightLoadError, match=rf"{e}.weight_packed.*expected shape \(32, 16\), got \(32, 15\)"
    ):
        load({f"{e}.weight_packed": torch.zeros(32, 15, dtype=torch.uint8)})
    with pytest.raises(WeightLoadError, match=rf"{e}.weight_packed.*no scale"):
        load({f"{e}.weight_scale": None})
    with pytest.raises(
        WeightLoadError,
        match=rf"scale of '{e}.weight_packed'.*expected shape \(32, 1\), got \(32, 3\)",
    ):
        load({f"{e}.weight_scale": torch.zeros(32, 3, dtype=torch.uint8)})
    with pytest.raises(
        WeightLoadError, match=r"missing tensor 'model\.layers\.2\.mlp\.experts\.5\.w2\.weight'"
    ):
        load({f"{e}.weight_packed": None, f"{e}.weight_scale": None})
    with pytest.raises(
        WeightLoadError, match=r"does not use, e\.g\. \['language_model\.model\.extra\.weight'\]"
    ):
        load({"language_model.model.extra.weight": torch.zeros(2)})
    load({"language_model.model.extra.weight": torch.zeros(2)}, strict=False)


def test_directory_round_trip_with_bf16_experts(tmp_path: Path) -> None:
    src = make_model(CONFIG_B, seed=5)
    # unquantised experts, every tensor in the model's own dtype (fp32): the reload is exact
    release.write_unquantised(tmp_path, CONFIG_B, src)
    model = load_model(
        tmp_path,
        LayerBuildSpec(dtype=torch.float32, moe_runner="torch"),
        LoadOptions(progress=False),
    )
    ids = tokens(9, seed=6)
    torch.testing.assert_close(
        model(ids, torch.arange(9)), src(ids, torch.arange(9)), rtol=0, atol=0
    )


def test_mega_weight_builder_gets_this_ranks_raw_experts() -> None:
    mega = {**CONFIG_A, "routed_expert_hidden_size": 512, "moe_intermediate_size": 128}
    src = make_model(mega, seed=9)
    ckpt = release.model_release_tensors(src).tensors
    got: dict[int, dict[str, Any]] = {}

    def builder(layer_id: int, raw: dict[str, torch.Tensor | None]) -> Any:
        got[layer_id] = raw
        return ("mega", layer_id)

    model = _fresh(mega, tp_rank=1, tp_size=2, a2a_backend="megamoe")
    load_weights(model, ckpt, LoadOptions(progress=False, mega_weight_builder=builder))
    assert sorted(got) == list(range(1, 8))
    raw = got[2]
    pre = "language_model.model.layers.2.block_sparse_moe.experts"
    assert (
        raw["w13"] is not None
        and raw["w13"].shape == (4, 256, 256)
        and raw["w13"].dtype == torch.uint8
    )
    assert torch.equal(
        raw["w13"][0, :128], ckpt[f"{pre}.4.w1.weight_packed"]
    )  # rank 1 holds experts 4..7
    assert torch.equal(raw["w2_scale"][3], ckpt[f"{pre}.7.w2.weight_scale"])  # type: ignore[index]
    moe = model.decoder_layers[2].mlp
    assert isinstance(moe, KimiK3MoE) and moe.experts.mega_weights == ("mega", 2)


# --- tensor parallel ------------------------------------------------------------------------------


def _rank_logits(
    rank: int, world: int, model_dir: str, ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    from sglang.srt.distributed import parallel_state as ps

    logging.getLogger("sglang").setLevel(logging.ERROR)  # the expected MegaMoE fallback warning
    ps.initialize_model_parallel(world)
    out: dict[str, torch.Tensor] = {}
    for a2a in ("none", "megamoe"):
        model = load_model(
            model_dir,
            LayerBuildSpec(
                dtype=torch.float32,
                tp_rank=rank,
                tp_size=world,
                moe_runner="torch",
                a2a_backend=a2a,
            ),
            LoadOptions(progress=False),
        )
        out[a2a] = model(ids, torch.arange(ids.shape[0]))
    cache = model.new_request_cache()
    steps = [model.prefill(ids[:9], cache)] + [
        model.decode(ids[i : i + 1], [cache]) for i in range(9, 12)
    ]
    out["steps"] = torch.cat(steps)
    ps.destroy_model_parallel()
    return out


def test_tp2_equals_tp1(tmp_path: Path) -> None:
    # 4 layers (MLA at 1-based 2 and 4, two bank writes), 4 heads of each kind split over 2
    # ranks, MegaMoE-shaped experts (latent 512, width 128) so both a2a layouts can be built.
    mega = {
        **CONFIG_A,
        "num_hidden_layers": 4,
        "attn_res_block_size": 2,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "routed_expert_hidden_size": 512,
        "moe_intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "linear_attn_config": {
            **CONFIG_A["linear_attn_config"],
            "num_heads": 4,
            "kda_layers": [1, 3],
            "full_attn_layers": [2, 4],
        },
    }
    src = make_model(mega, seed=11)
    # MXFP4 experts, dense tensors in fp32 (the reference's dtype)
    ckpt = release.write_from_tensors(tmp_path, mega, release.from_model(src), dense_dtype=None)
    assert ckpt.values is not None
    ids = tokens(12, seed=12)
    want = _from_values(mega, ckpt.values)(ids, torch.arange(12))
    for rank, out in enumerate(run_distributed(_rank_logits, 2, str(tmp_path), ids)):
        for key in ("none", "megamoe", "steps"):
            torch.testing.assert_close(
                out[key], want, rtol=1e-4, atol=1e-4, msg=f"rank {rank} {key}"
            )


if __name__ == "__main__":
    run_this_file(__file__)
