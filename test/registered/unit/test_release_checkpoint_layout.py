"""The test kit's release-format checkpoint writers (``sglang.test.release_checkpoint``) against
the published layouts, with the expected names, shapes and dtypes written here from the design
notes (``shipped_precision.md``, ``deepseek_v4.md`` §3, ``kimi_k3.md`` §4), not from the
writers' tables:

- DeepSeek V4: release names incl. an ``mtp.0.*`` layer and ``tid2eid``, FP8 e4m3 dense weights
  with ``float8_e8m0fnu`` 128x128 scales (or fp32 ``weight_scale_inv``), MXFP4 experts (int8
  ``[I, H/2]`` / ``[H, I/2]`` + e8m0 per 32), bf16 / fp32 for the rest, ``config.json`` with its
  ``quantization_config`` and a ratio for the MTP layer;
- Kimi K3: the wrapper's ``language_model.`` names, ``block_sparse_moe`` layers, compressed-
  tensors ``weight_packed`` / ``weight_scale`` uint8 experts, fp32 KDA tensors, the wrapper
  ``config.json`` with compressed-tensors' ``quantization_config``;
- shards + ``model.safetensors.index.json`` agree with the files; the dequantised values each
  writer reports equal an independent decode of the written bytes; random tensors are never zero
  and their block scales differ;
- the byte accounting: groups, a TP / EP rank's share, and each tensor's split checked against
  the engine's own sharding (meta-device models at TP=1 and TP=2).
"""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.models import deepseek_v4_checkpoint, kimi_k3_checkpoint
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.models.kimi_k3_config import KimiK3Config
from sglang.test.ci_register import register_cpu_ci
from sglang.test.release_checkpoint import deepseek_v4, kimi_k3
from sglang.test.release_checkpoint.emit import ReleaseCheckpoint, random_source
from sglang.test.release_checkpoint.layout import (
    CheckpointLayout,
    Format,
    Group,
    Split,
    TensorEntry,
    TensorSpec,
)
from sglang.test.run import run_this_file

register_cpu_ci(est_time=8)

E4M3, E8M0, BF16, FP32 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16, torch.float32
SHARD = 100_000  # bytes: the tiny checkpoints span several shards


def _files(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle
                out[name] = f.get_tensor(name)
    return out


def _check_shards(path: Path) -> dict[str, torch.Tensor]:
    """The index names every tensor of the shards, each in its own file, with the total size."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    n = len(shards)
    assert n >= 2
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    total = 0
    for file in shards:
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                assert index["weight_map"][name] == file
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
    tensors = _files(path)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == total
    return tensors


def _check_layout(
    path: Path, want: dict[str, tuple[tuple[int, ...], Any]]
) -> dict[str, torch.Tensor]:
    """:func:`_check_shards`, and the shards hold exactly the tensors of ``want`` (name ->
    (shape, dtype))."""
    files = _check_shards(path)
    assert sorted(set(files) - set(want)) == [] and sorted(set(want) - set(files)) == []
    bad = {
        n: ((tuple(t.shape), t.dtype), want[n])
        for n, t in files.items()
        if (tuple(t.shape), t.dtype) != want[n]
    }
    assert bad == {}
    return files


# --- independent decoders ------------------------------------------------------------------------

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _pow2(scale_bytes: torch.Tensor) -> torch.Tensor:
    return torch.exp2(scale_bytes.view(torch.uint8).double() - 127)


def _decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 15, b >> 4], -1).flatten(-2)  # low nibble first
    table = torch.tensor(_E2M1 + [-v for v in _E2M1], dtype=torch.float64)
    return (table[codes] * _pow2(scale).repeat_interleave(32, -1)).float()


def _decode_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = _pow2(scale) if scale.dtype == E8M0 else scale.double()
    full = s.repeat_interleave(128, -2).repeat_interleave(128, -1)
    return (q.double() * full[: q.shape[0], : q.shape[1]]).float()


# --- DeepSeek V4 ---------------------------------------------------------------------------------

DS = deepseek_v4.TINY_CONFIG  # 3 layers: ratios 0 / 4 / 128, layer 0 hash-routed, 4 experts
H, V, I, E = 64, 96, 32, 4
HEADS, HD, QR, OG, OR = 4, 32, 16, 2, 8
IH, ID, HC = 16, 16, 4


def _dsv4_layer(p: str, ratio: int, hashed: bool) -> dict[str, tuple[tuple[int, ...], Any]]:
    """One decoder layer's release tensors: name -> (shape, dtype), from deepseek_v4.md §3."""
    mix = (2 + HC) * HC
    t: dict[str, tuple[tuple[int, ...], Any]] = {}
    for site in ("attn", "ffn"):
        t[f"{p}hc_{site}_fn"] = ((mix, HC * H), FP32)
        t[f"{p}hc_{site}_base"] = ((mix,), FP32)
        t[f"{p}hc_{site}_scale"] = ((3,), FP32)
    t[f"{p}attn_norm.weight"] = t[f"{p}ffn_norm.weight"] = ((H,), BF16)

    def fp8(name: str, n: int, k: int) -> None:
        t[f"{name}.weight"] = ((n, k), E4M3)
        t[f"{name}.scale"] = ((-(-n // 128), -(-k // 128)), E8M0)

    fp8(f"{p}attn.wq_a", QR, H)
    fp8(f"{p}attn.wq_b", HEADS * HD, QR)
    fp8(f"{p}attn.wkv", HD, H)
    fp8(f"{p}attn.wo_a", OG * OR, HEADS * HD // OG)
    fp8(f"{p}attn.wo_b", H, OG * OR)
    t[f"{p}attn.q_norm.weight"] = ((QR,), BF16)
    t[f"{p}attn.kv_norm.weight"] = ((HD,), BF16)
    t[f"{p}attn.attn_sink"] = ((HEADS,), FP32)
    if ratio:
        width = HD * (2 if ratio == 4 else 1)
        t[f"{p}attn.compressor.wkv.weight"] = t[f"{p}attn.compressor.wgate.weight"] = (
            (width, H),
            BF16,
        )
        t[f"{p}attn.compressor.ape"] = ((ratio, width), FP32)
        t[f"{p}attn.compressor.norm.weight"] = ((HD,), FP32)
    if ratio == 4:
        fp8(f"{p}attn.indexer.wq_b", IH * ID, QR)
        t[f"{p}attn.indexer.weights_proj.weight"] = ((IH, H), BF16)
        c = f"{p}attn.indexer.compressor."
        t[f"{c}wkv.weight"] = t[f"{c}wgate.weight"] = ((2 * ID, H), BF16)
        t[f"{c}ape"] = ((4, 2 * ID), FP32)
        t[f"{c}norm.weight"] = ((ID,), FP32)
    t[f"{p}ffn.gate.weight"] = ((E, H), BF16)
    if hashed:
        t[f"{p}ffn.gate.tid2eid"] = ((V, 2), torch.int32)
    else:
        t[f"{p}ffn.gate.bias"] = ((E,), FP32)
    for e in range(E):
        for w, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            t[f"{p}ffn.experts.{e}.{w}.weight"] = ((n, k // 2), torch.int8)
            t[f"{p}ffn.experts.{e}.{w}.scale"] = ((n, k // 32), E8M0)
    for w, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
        fp8(f"{p}ffn.shared_experts.{w}", n, k)
    return t


def _dsv4_expected() -> dict[str, tuple[tuple[int, ...], Any]]:
    t = {
        "embed.weight": ((V, H), BF16),
        "head.weight": ((V, H), BF16),
        "norm.weight": ((H,), BF16),
        "hc_head_fn": ((HC, HC * H), FP32),
        "hc_head_base": ((HC,), FP32),
        "hc_head_scale": ((1,), FP32),
    }
    for i, ratio in enumerate((0, 4, 128)):
        t |= _dsv4_layer(f"layers.{i}.", ratio, hashed=i == 0)
    # the MTP layer: a ratio-0, non-hash decoder layer plus its own projections and head
    t |= _dsv4_layer("mtp.0.", 0, hashed=False)
    for proj in ("e_proj", "h_proj"):
        t[f"mtp.0.{proj}.weight"] = ((H, H), E4M3)
        t[f"mtp.0.{proj}.scale"] = ((1, 1), E8M0)
    for norm in ("enorm", "hnorm", "norm"):
        t[f"mtp.0.{norm}.weight"] = ((H,), BF16)
    t["mtp.0.hc_head_fn"] = ((HC, HC * H), FP32)
    t["mtp.0.hc_head_base"] = ((HC,), FP32)
    t["mtp.0.hc_head_scale"] = ((1,), FP32)
    return t


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory: pytest.TempPathFactory) -> ReleaseCheckpoint:
    path = tmp_path_factory.mktemp("dsv4_release")
    return deepseek_v4.write_random(path, DS, seed=1, max_shard_bytes=SHARD)


def test_dsv4_names_dtypes_shapes_and_shards(dsv4: ReleaseCheckpoint) -> None:
    files = _check_layout(dsv4.path, _dsv4_expected())
    table = files["layers.0.ffn.gate.tid2eid"]
    assert int(table.min()) >= 0 and int(table.max()) < E
    assert all(len(set(row.tolist())) == 2 for row in table)  # distinct experts per token
    # the layout records exactly the files
    assert {n: (e.shape, e.dtype) for n, e in dsv4.layout.entries.items()} == {
        n: (tuple(t.shape), t.dtype) for n, t in files.items()
    }


def test_dsv4_config_json(dsv4: ReleaseCheckpoint) -> None:
    raw = json.loads((dsv4.path / "config.json").read_text())
    assert raw == dict(dsv4.config)
    assert raw["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    assert raw["model_type"] == "deepseek_v4"
    assert raw["architectures"] == ["DeepseekV4ForCausalLM"]
    assert raw["compress_ratios"] == [0, 4, 128, 0]  # one more for the MTP layer
    assert raw["num_nextn_predict_layers"] == 1 and raw["num_hidden_layers"] == 3
    parsed = DeepseekV4ModelConfig.from_json_file(dsv4.path)
    assert parsed.quant_method == "fp8" and parsed.compress_ratios == (0, 4, 128)


def test_dsv4_values_are_the_decoded_files(dsv4: ReleaseCheckpoint) -> None:
    files, values = _files(dsv4.path), dsv4.values
    assert values is not None
    for name, v in values.items():
        assert v.dtype in (FP32, torch.int32), name
        base = name.removesuffix(".weight")
        if name.endswith(".tid2eid"):
            assert torch.equal(v, files[name])
        elif files[name].dtype == E4M3:
            assert torch.equal(v, _decode_fp8(files[name], files[f"{base}.scale"])), name
        elif files[name].dtype == torch.int8:
            assert torch.equal(v, _decode_mxfp4(files[name], files[f"{base}.scale"])), name
        else:
            assert torch.equal(v, files[name].float()), name
        assert float(v.float().abs().max()) > 0, f"{name} is all zeros"
    # scales really vary: per MXFP4 group within one expert, and between FP8 matrices
    one_expert = files["layers.1.ffn.experts.2.w2.scale"].view(torch.uint8)
    assert len(one_expert.unique()) >= 3
    dense_scales = [t for n, t in files.items() if n.endswith(".scale") and ".experts." not in n]
    fp8_scales = {int(t.view(torch.uint8)[0, 0]) for t in dense_scales}
    assert len(fp8_scales) >= 3


def test_fp8_block_scales_vary_within_a_matrix() -> None:
    spec = TensorSpec("w", (256, 384), Format.FP8_BLOCK, Group.DENSE_FP8, Split.TP)
    w = random_source(3, "cpu")([spec])[0]
    tiles = w.view(2, 128, 3, 128).abs().amax(dim=(1, 3))
    exponents = torch.ceil(torch.log2(tiles / 448))
    assert len(exponents.unique()) >= 2 and float(w.abs().min()) > 0


def test_dsv4_fp32_scale_export(tmp_path: Path, dsv4: ReleaseCheckpoint) -> None:
    # Some exports name the FP8 scale weight_scale_inv and store it in fp32; same values.
    other = deepseek_v4.write_random(tmp_path, DS, seed=1, scale_format="fp32", mtp=False)
    files = _files(tmp_path)
    assert files["layers.1.attn.wq_b.weight_scale_inv"].dtype == FP32
    assert "layers.1.attn.wq_b.scale" not in files
    assert not any(n.startswith("mtp.") for n in files)
    assert files["layers.1.ffn.experts.0.w1.scale"].dtype == E8M0  # MXFP4 scales stay UE8M0
    assert other.values is not None and dsv4.values is not None
    for name in ("layers.1.attn.wq_b.weight", "layers.2.ffn.experts.3.w2.weight"):
        assert torch.equal(other.values[name], dsv4.values[name])


# --- Kimi K3 -------------------------------------------------------------------------------------

K3 = kimi_k3.TINY_CONFIG  # 8 layers, MLA at 1-based 4 and 8, dense layer 0, blocks of 3
KH, KL, KI, KE, KV = 64, 32, 32, 8, 97
KDA_HEADS, KDA_DIM = 2, 16
MLA_HEADS, QL, KVL, NOPE, ROPE, VD = 2, 24, 32, 16, 8, 16


def _k3_expected() -> dict[str, tuple[tuple[int, ...], Any]]:
    lm = "language_model.model."
    t: dict[str, tuple[tuple[int, ...], Any]] = {
        f"{lm}embed_tokens.weight": ((KV, KH), BF16),
        "language_model.lm_head.weight": ((KV, KH), BF16),
        f"{lm}norm.weight": ((KH,), BF16),
        f"{lm}output_attn_res_norm.weight": ((KH,), BF16),
        f"{lm}output_attn_res_proj.weight": ((1, KH), BF16),
    }
    w = KDA_HEADS * KDA_DIM
    for i in range(8):
        p = f"{lm}layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}{n}.weight"] = ((KH,), BF16)
        for site in ("self_attention", "mlp"):
            t[f"{p}{site}_res_norm.weight"] = ((KH,), BF16)
            t[f"{p}{site}_res_proj.weight"] = ((1, KH), BF16)
        a = f"{p}self_attn."
        if i in (3, 7):  # MLA
            t[f"{a}q_a_proj.weight"] = ((QL, KH), BF16)
            t[f"{a}q_a_layernorm.weight"] = ((QL,), BF16)
            t[f"{a}q_b_proj.weight"] = ((MLA_HEADS * (NOPE + ROPE), QL), BF16)
            t[f"{a}kv_a_proj_with_mqa.weight"] = ((KVL + ROPE, KH), BF16)
            t[f"{a}kv_a_layernorm.weight"] = ((KVL,), BF16)
            t[f"{a}kv_b_proj.weight"] = ((MLA_HEADS * (NOPE + VD), KVL), BF16)
            t[f"{a}g_proj.weight"] = ((MLA_HEADS * VD, KH), BF16)
            t[f"{a}o_proj.weight"] = ((KH, MLA_HEADS * VD), BF16)
        else:  # KDA
            for x in "qkvg":
                t[f"{a}{x}_proj.weight"] = ((w, KH), BF16)
            for x in "qkv":
                t[f"{a}{x}_conv1d.weight"] = ((w, 1, 4), FP32)
            t[f"{a}b_proj.weight"] = ((KDA_HEADS, KH), BF16)
            t[f"{a}f_a_proj.weight"] = ((KDA_DIM, KH), BF16)
            t[f"{a}f_b_proj.weight"] = ((w, KDA_DIM), BF16)
            t[f"{a}A_log"] = ((KDA_DIM,), FP32)  # released as [head_dim]
            t[f"{a}dt_bias"] = ((w,), FP32)
            t[f"{a}o_norm.weight"] = ((KDA_DIM,), FP32)
            t[f"{a}o_proj.weight"] = ((KH, w), BF16)
        if i == 0:  # dense
            t[f"{p}mlp.gate_proj.weight"] = t[f"{p}mlp.up_proj.weight"] = ((96, KH), BF16)
            t[f"{p}mlp.down_proj.weight"] = ((KH, 96), BF16)
            continue
        m = f"{p}block_sparse_moe."
        t[f"{m}gate.weight"] = ((KE, KH), BF16)
        t[f"{m}gate.e_score_correction_bias"] = ((KE,), FP32)
        t[f"{m}routed_expert_down_proj.weight"] = ((KL, KH), BF16)
        t[f"{m}routed_expert_up_proj.weight"] = ((KH, KL), BF16)
        t[f"{m}routed_expert_norm.weight"] = ((KL,), BF16)
        t[f"{m}shared_experts.gate_proj.weight"] = ((2 * KI, KH), BF16)
        t[f"{m}shared_experts.up_proj.weight"] = ((2 * KI, KH), BF16)
        t[f"{m}shared_experts.down_proj.weight"] = ((KH, 2 * KI), BF16)
        for e in range(KE):
            for proj, (n, k) in (("w1", (KI, KL)), ("w3", (KI, KL)), ("w2", (KL, KI))):
                t[f"{m}experts.{e}.{proj}.weight_packed"] = ((n, k // 2), torch.uint8)
                t[f"{m}experts.{e}.{proj}.weight_scale"] = ((n, k // 32), torch.uint8)
    return t


@pytest.fixture(scope="module")
def k3(tmp_path_factory: pytest.TempPathFactory) -> ReleaseCheckpoint:
    path = tmp_path_factory.mktemp("k3_release")
    return kimi_k3.write_random(path, K3, seed=2, max_shard_bytes=SHARD)


def test_k3_names_dtypes_shapes_and_shards(k3: ReleaseCheckpoint) -> None:
    _check_layout(k3.path, _k3_expected())


def test_k3_config_json(k3: ReleaseCheckpoint) -> None:
    raw = json.loads((k3.path / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3"
    assert raw["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert raw["text_config"] == {**K3, "model_type": "kimi_linear"}
    q = raw["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mxfp4-pack-quantized"
    (group,) = q["config_groups"].values()
    assert group["format"] == "mxfp4-pack-quantized"
    weights = group["weights"]
    assert (weights["num_bits"], weights["type"], weights["group_size"]) == (4, "float", 32)
    assert (weights["strategy"], weights["symmetric"], weights["dynamic"]) == ("group", True, False)
    expert = "language_model.model.layers.1.block_sparse_moe.experts.7.w2"
    assert all(re.fullmatch(t.removeprefix("re:"), expert) for t in group["targets"])
    assert KimiK3Config.from_json_file(k3.path).expert_quant_format == "mxfp4"


def test_k3_values_are_the_decoded_files(k3: ReleaseCheckpoint) -> None:
    files, values = _files(k3.path), k3.values
    assert values is not None
    for name, v in values.items():
        if name.endswith(".weight") and f"{name.removesuffix('.weight')}.weight_packed" in files:
            base = name.removesuffix(".weight")
            want = _decode_mxfp4(files[f"{base}.weight_packed"], files[f"{base}.weight_scale"])
        else:
            want = files[name].float()
        assert v.dtype == FP32 and torch.equal(v, want), name
        assert float(v.abs().max()) > 0, f"{name} is all zeros"
    scales = files["language_model.model.layers.5.block_sparse_moe.experts.1.w1.weight_scale"]
    assert len(scales.unique()) >= 3


def test_k3_vision_tensors_are_not_loaded(tmp_path: Path) -> None:
    r = kimi_k3.write_random(tmp_path, kimi_k3.tiny_config(layers=2), vision=True)
    skipped = [e.name for e in r.layout.entries.values() if e.split is Split.NOT_LOADED]
    assert skipped and all(kimi_k3_checkpoint.canonical_name(n) is None for n in skipped)
    assert r.layout.rank_bytes().get(Group.NOT_LOADED, 0) == 0


# --- byte accounting -----------------------------------------------------------------------------


def test_rank_bytes_arithmetic() -> None:
    def entry(name: str, nbytes: int, group: Group, split: Split) -> TensorEntry:
        return TensorEntry(name, torch.uint8, (nbytes,), nbytes, group, split)

    layout = CheckpointLayout.of(
        {
            e.name: e
            for e in (
                entry("embed", 1000, Group.EMBEDDINGS, Split.REPLICATED),
                entry("wq_b", 800, Group.DENSE_FP8, Split.TP),
                entry("wq_b.scale", 3, Group.DENSE_FP8_SCALES, Split.TP),
                entry("shared", 400, Group.DENSE_FP8, Split.SHARED_EXPERT),
                entry("experts", 16000, Group.EXPERTS, Split.ROUTED_EXPERT),
                entry("mtp", 5000, Group.NOT_LOADED, Split.NOT_LOADED),
            )
        },
        num_experts=8,
    )
    assert layout.total_bytes() == 23203
    assert layout.rank_bytes() == {
        Group.EMBEDDINGS: 1000,
        Group.DENSE_FP8: 1200,
        Group.DENSE_FP8_SCALES: 3,
        Group.EXPERTS: 16000,
    }
    tp4 = layout.rank_bytes(4)
    assert tp4[Group.DENSE_FP8] == 200 + 100 and tp4[Group.EXPERTS] == 4000
    assert tp4[Group.DENSE_FP8_SCALES] == 1  # a rank holding part of a tile holds its scale
    ep = layout.rank_bytes(4, 2)  # shared experts whole under EP, routed still 1/tp
    assert ep[Group.DENSE_FP8] == 200 + 400 and ep[Group.EXPERTS] == 4000
    assert layout.rank_total_bytes(4, 4) == 1000 + 200 + 1 + 400 + 4000
    with pytest.raises(ValueError, match="ep_size 3 must divide tp_size 4"):
        layout.rank_bytes(4, 3)
    with pytest.raises(ValueError, match="8 routed experts do not split over 16"):
        layout.rank_bytes(16, 16)
    assert "| total | 6 |" in layout.format_table(4, 2)


def _engine_fraction(build: Any) -> dict[str, float]:
    """Each dense parameter's share on one rank of TP=2 in the engine (meta-device models)."""
    one = {n: p.numel() for n, p in build(1).named_parameters()}
    two = {n: p.numel() for n, p in build(2).named_parameters()}
    return {n: two[n] / one[n] for n in one}


@pytest.mark.parametrize("model", ["deepseek_v4", "kimi_k3"])
def test_splits_match_the_engine_sharding(
    model: str, dsv4: ReleaseCheckpoint, k3: ReleaseCheckpoint
) -> None:
    if model == "deepseek_v4":
        ckpt, canonical = dsv4, deepseek_v4_checkpoint.canonical_name
        cfg = DeepseekV4ModelConfig.from_dict(DS)

        def build(tp: int) -> Any:
            spec = LayerBuildSpec(dtype=FP32, device="meta", moe_runner="torch", tp_size=tp)
            return DeepseekV4ForCausalLM(cfg, spec)
    else:
        ckpt, canonical = k3, kimi_k3_checkpoint.canonical_name
        kcfg = KimiK3Config.from_dict(K3)

        def build(tp: int) -> Any:
            spec = LayerBuildSpec(dtype=FP32, device="meta", moe_runner="torch", tp_size=tp)
            return KimiK3ForCausalLM(kcfg, spec)

    fraction = _engine_fraction(build)
    checked = 0
    for name, e in ckpt.layout.entries.items():
        param = canonical(name)
        if param is None or param not in fraction or name.endswith("A_log"):
            continue  # skipped tensors, routed experts (held by FusedMoE), A_log ([D] -> [H])
        want = {1.0: {Split.REPLICATED}, 0.5: {Split.TP, Split.SHARED_EXPERT}}[fraction[param]]
        assert e.split in want, (name, e.split, fraction[param])
        checked += 1
    assert checked > 40
    # and the routed experts are all ROUTED_EXPERT, the MTP / vision tensors NOT_LOADED
    for name, e in ckpt.layout.entries.items():
        if canonical(name) is None:
            assert e.split is Split.NOT_LOADED, name
        elif ".experts." in name and "shared" not in name:
            assert e.split is Split.ROUTED_EXPERT, name


def test_writer_refuses_a_state_dict_that_does_not_fit(tmp_path: Path) -> None:
    values = dict(deepseek_v4.release_tensors(DS, _dsv4_random_values()).values)
    del values["layers.1.attn.wq_b.weight"]
    values["layers.1.attn.typo.weight"] = torch.ones(2)
    with pytest.raises(ValueError, match=r"missing \['layers.1.attn.wq_b.weight'\].*typo"):
        deepseek_v4.write_from_tensors(tmp_path, DS, values)
    values = dict(deepseek_v4.release_tensors(DS, _dsv4_random_values()).values)
    values["layers.2.attn.wo_b.weight"] = values["layers.2.attn.wo_b.weight"].t()
    with pytest.raises(ValueError, match=r"layers.2.attn.wo_b.weight.*needs \(64, 16\)"):
        deepseek_v4.write_from_tensors(tmp_path, DS, values)


def test_bad_formats_are_refused() -> None:
    with pytest.raises(ValueError, match=r"dense='fp4' is not one of \('fp8', 'bf16'\)"):
        list(deepseek_v4.tensor_specs(DS, dense="fp4"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"experts='fp8' is not one of \('mxfp4', 'bf16'\)"):
        list(kimi_k3.tensor_specs(K3, experts="fp8"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compress_ratios with one ratio per layer"):
        deepseek_v4.release_config({**DS, "compress_ratios": [0, 4]})


SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "write_release_checkpoint.py"


@pytest.mark.parametrize("model", ["deepseek_v4", "kimi_k3"])
def test_write_release_checkpoint_script(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ckpt"
    argv = [str(SCRIPT), "--model", model, "--preset", "tiny", "--layers", "2"]
    argv += ["--experts", "4", "--out", str(out), "--tp-size", "2", "--max-shard-gb", "0.0001"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPT), run_name="__main__")
    printed = capsys.readouterr().out
    shards = len(list(out.glob("model-*-of-*.safetensors")))
    assert shards >= 2 and f"2 layers, 4 routed experts -> {out} ({shards} shards" in printed
    assert "| routed experts | " in printed and "rank of tp2" in printed
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == int(re.search(r"\| total \| (\d+) \|", printed)[1])
    monkeypatch.setattr(sys, "argv", argv)  # the directory is not empty now
    with pytest.raises(SystemExit):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert "is not empty" in capsys.readouterr().err


def _dsv4_random_values() -> dict[str, torch.Tensor]:
    specs = list(deepseek_v4.tensor_specs(DS, mtp=False))
    draw = random_source(5, "cpu")
    return {s.name: draw([s])[0] for s in specs}


if __name__ == "__main__":
    run_this_file(__file__)
