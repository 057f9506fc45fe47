"""A release-format DeepSeek V4 checkpoint at real widths (hidden 4096, 64 heads of 512, expert
intermediate 2048; two layers, 32 routed experts to keep the files small) with MXFP4 experts,
loaded on the GPU: what stays resident, measured with ``torch.cuda.memory_allocated``, agrees with
the load report, and is at most 1.05x the checkpoint bytes of the rank's share per layer and for
the whole model.

- dense weights in bf16: the experts stay packed MXFP4, nothing is copied;
- dense weights in FP8 128x128 with UE8M0 scales (as released): the FP8 layers stay FP8 resident;
- ``--moe-a2a-backend megamoe`` on Hopper: the experts become FP8 in ``fp8_mega_moe``'s layout, the
  only copy (~1.9x the MXFP4 bytes, every block exact for these scales), and nothing else grows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang.srt.mem_cache.memory_models.weight_bytes import resident_vs_checkpoint
from sglang.test.ci_register import register_cuda_ci
from sglang.test.real_deep_gemm import deep_gemm_or_skip
from sglang.test.run import run_this_file

register_cuda_ci(est_time=150, suite="h200-1gpu")

EXPERTS = 32


def _config() -> dict[str, Any]:
    from sglang.test.wide_dsv4 import wide_dsv4_config

    return {**wide_dsv4_config([4, 128]), "n_routed_experts": EXPERTS}


def write_release_checkpoint(path: Path, *, fp8_dense: bool) -> None:
    """The release layout from the test kit: dense in FP8 128x128 with UE8M0 ``.scale`` where the
    release quantises (or all bf16), per-expert MXFP4 ``w1``/``w2``/``w3`` with e8m0 scales, an
    MTP layer (skipped by the loader), sharded with an index; drawn on the GPU."""
    from sglang.test.release_checkpoint import deepseek_v4 as release

    release.write_random(
        path,
        _config(),
        device="cuda",
        dense="fp8" if fp8_dense else "bf16",
        experts="mxfp4",
        keep_values=False,
    )


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
    assert "fp8" in report.resident.by_group()["attention"]  # dense FP8 stays FP8
    bad = [r for r in report.ratios if r.ratio > 1.05]
    assert not bad, bad


def test_hopper_megamoe_keeps_one_fp8_copy(
    release_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    deep_gemm_or_skip()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the SM90 MegaMoE needs a Hopper GPU")
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
