"""A release-format DeepSeek V4 checkpoint at real widths (hidden 4096, 64 heads of 512, expert
intermediate 2048; two layers, 32 routed experts to keep the files small) with MXFP4 experts,
loaded on the GPU: what stays resident, measured with ``torch.cuda.memory_allocated``, agrees with
the load report, and is at most 1.05x the checkpoint bytes of the rank's share per layer and for
the whole model.

- dense weights in bf16: must hold today (the experts stay packed MXFP4, nothing is copied);
- dense weights in FP8 128x128 with UE8M0 scales (as released): holds once dense FP8 layers stay
  FP8 resident; until then the attention is dequantised to bf16 and the test says so (xfail);
- ``--moe-a2a-backend megamoe`` on Hopper: the experts become FP8 in ``fp8_mega_moe``'s layout, the
  only copy (~1.9x the MXFP4 bytes, every block exact for these scales), and nothing else grows.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang.srt.mem_cache.memory_models.weight_bytes import resident_vs_checkpoint
from sglang.test.ci_register import register_cuda_ci
from sglang.test.run import run_this_file

register_cuda_ci(est_time=150, suite="h200-1gpu")

EXPERTS = 32
# The dense weights the release stores in FP8 (deepseek_v4.md, section 3).
_FP8_DENSE = re.compile(
    r"\.(attn\.(wq_a|wkv|wq_b|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$"
)


def _config() -> dict[str, Any]:
    from sglang.test.wide_dsv4 import wide_dsv4_config

    return {**wide_dsv4_config([4, 128]), "n_routed_experts": EXPERTS}


def _ue8m0_block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> e4m3 with one power-of-two (UE8M0) scale per 128x128 block."""
    n, k = w.shape
    tiles = w.float().view(n // 128, 128, k // 128, 128)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
    return q, scale.to(torch.float8_e8m0fnu)


def write_release_checkpoint(path: Path, *, fp8_dense: bool) -> None:
    """The release layout: every parameter under its release name (dense in bf16, or in FP8 with
    a ``.scale`` where the release quantises), per-expert MXFP4 ``w1``/``w2``/``w3`` as int8 with
    float8_e8m0fnu ``.scale``, a safetensors index over two shards."""
    import json

    from safetensors.torch import save_file

    from sglang.srt.layers.build_spec import LayerBuildSpec
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
    from sglang.test.random_params import randomize_params_

    cfg = _config()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator(device="cuda").manual_seed(0)
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_dict(cfg),
        LayerBuildSpec(dtype=torch.bfloat16, moe_runner="torch", device="cuda"),
    )
    with torch.no_grad():
        randomize_params_(model, gen, vector_scale=0.1)
    dense: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if fp8_dense and _FP8_DENSE.search(name):
            q, s = _ue8m0_block_fp8(t)
            dense[name], dense[name.removesuffix(".weight") + ".scale"] = q.cpu(), s.cpu()
        else:
            dense[name] = t.cpu().clone()
    del model
    torch.cuda.empty_cache()
    experts: dict[str, torch.Tensor] = {}
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    for layer in range(cfg["num_hidden_layers"]):
        for e in range(EXPERTS):
            for w, (rows, cols) in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
                pre = f"layers.{layer}.ffn.experts.{e}.{w}"
                packed = torch.randint(0, 256, (rows, cols // 2), device="cuda", generator=gen)
                scale = torch.randint(118, 125, (rows, cols // 32), device="cuda", generator=gen)
                experts[pre + ".weight"] = packed.to(torch.uint8).view(torch.int8).cpu()
                experts[pre + ".scale"] = scale.to(torch.uint8).view(torch.float8_e8m0fnu).cpu()
    shards = {
        "model-00001-of-00002.safetensors": dense,
        "model-00002-of-00002.safetensors": experts,
    }
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(path / file))
        weight_map.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.fixture(scope="module")
def release_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dirs = {}
    for kind in ("bf16", "fp8"):
        dirs[kind] = tmp_path_factory.mktemp(f"dsv4_release_{kind}")
        write_release_checkpoint(dirs[kind], fp8_dense=kind == "fp8")
    return dirs


def _load(path: Path, a2a: str = "none") -> tuple[Any, Any, int]:
    """(model, load report, bytes allocated by building and loading it)."""
    from sglang.srt.layers.build_spec import LayerBuildSpec
    from sglang.srt.model_loader.checkpoint_loop import load_checkpoint
    from sglang.srt.model_loader.load_options import LoadOptions
    from sglang.srt.model_loader.weight_source import SafetensorsWeightSource
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sglang.srt.models.deepseek_v4_checkpoint import checkpoint_rules
    from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = DeepseekV4ForCausalLM(
        DeepseekV4ModelConfig.from_json_file(path),
        LayerBuildSpec(dtype=torch.bfloat16, moe_runner="auto", a2a_backend=a2a, device="cuda"),
    )
    with SafetensorsWeightSource(path) as source:
        report = load_checkpoint(
            model, source, checkpoint_rules(model.config), LoadOptions(progress=False)
        )
    torch.cuda.synchronize()
    return model.eval(), report, torch.cuda.memory_allocated() - before


def _check_measured(report: Any, allocated: int) -> None:
    resident = report.resident.total()
    # the allocator rounds each tensor up to 512 bytes; nothing but the weights stays allocated
    assert resident <= allocated <= resident * 1.01 + (16 << 20), (allocated, resident)


def test_bf16_dense_mxfp4_experts_stay_within_1_05x(release_dirs: dict[str, Path]) -> None:
    model, report, allocated = _load(release_dirs["bf16"])
    _check_measured(report, allocated)
    for layer in model.decoder_layers:
        w = layer.ffn.experts.weights
        assert w is not None and w.is_mxfp4 and w.device.type == "cuda"
    assert report.resident.by_group()["routed_experts"].keys() == {"mxfp4"}
    bad = [r for r in report.ratios if r.ratio > 1.05]
    print(
        "\n"
        + "\n".join(
            f"layer {r.layer}: resident {r.resident / 2**20:.1f} MiB / checkpoint "
            f"{r.checkpoint / 2**20:.1f} MiB = {r.ratio:.4f}"
            for r in report.ratios
        )
    )
    assert not bad, bad
    ids = torch.randint(0, 4096, (16,), device="cuda")
    with torch.no_grad():
        logits = model(ids, torch.arange(16, device="cuda"))
    assert logits.shape == (16, 4096) and torch.isfinite(logits).all()


def test_release_fp8_dense_mxfp4_experts_stay_within_1_05x(release_dirs: dict[str, Path]) -> None:
    _, report, allocated = _load(release_dirs["fp8"])
    _check_measured(report, allocated)
    assert report.checkpoint.by_group()["attention"].keys() >= {"fp8"}
    assert report.resident.by_group()["routed_experts"].keys() == {"mxfp4"}
    routed = resident_vs_checkpoint(
        report.resident.only("routed_experts"), report.checkpoint.only("routed_experts")
    )
    assert max(r.ratio for r in routed) <= 1.0
    if "fp8" not in report.resident.by_group()["attention"]:
        pytest.xfail("dense FP8 weights are dequantised to bf16 at load on this tree")
    bad = [r for r in report.ratios if r.ratio > 1.05]
    assert not bad, bad


def test_hopper_megamoe_keeps_one_fp8_copy(
    release_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.layers.deep_gemm_adapter import deep_gemm_status

    status = deep_gemm_status()
    if not status.usable or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"needs DeepGEMM on Hopper: {status.reason}")
    logging.getLogger("sglang").propagate = True
    with caplog.at_level(logging.INFO, logger="sglang"):
        model, report, allocated = _load(release_dirs["bf16"], "megamoe")
    _check_measured(report, allocated)
    line = next(r.getMessage() for r in caplog.records if "converted to FP8" in r.getMessage())
    assert "for fp8_mega_moe" in line and "every block exact" in line, line
    for layer in model.decoder_layers:
        experts = layer.ffn.experts
        w = experts.weights
        assert w is not None and w.is_mega and w.is_fp8
        assert experts.mega_weights is not None and experts.mega_weights[0][0] is w.w13
    routed = resident_vs_checkpoint(
        report.resident.only("routed_experts"), report.checkpoint.only("routed_experts")
    )
    assert all(1.8 < r.ratio < 1.95 for r in routed), routed
    others = ("attention", "shared_experts", "embeddings_head", "other")
    rest = resident_vs_checkpoint(report.resident.only(*others), report.checkpoint.only(*others))
    assert rest[-1].ratio <= 1.05, rest[-1]


if __name__ == "__main__":
    run_this_file(__file__)
