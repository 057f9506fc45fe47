"""The measured-path table and the fused-MoE kernel tables: lookups, buckets, fallbacks, the
deep_gemm runner's measured layout choice and the Triton MegaMoE's measured-slower guard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglang.kernels.ops.moe import tuned_configs as tc
from sglang.kernels.ops.moe.fused_moe import FusedMoeConfig, GemmTile, get_config
from sglang.kernels.ops.moe.grouped_gemm_tma import TmaGemmTile, TmaMoeConfig, tma_config_fits
from sglang.kernels.ops.moe.mxfp4_config import DTYPE_KEY as MXFP4_KEY
from sglang.kernels.ops.moe.mxfp4_config import load_mxfp4_table, mxfp4_config_fits
from sglang.srt.layers.moe.moe_runner import path_table as pt
from sglang.srt.layers.moe.moe_runner.deep_gemm import measured_layout
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=5)


def test_buckets_take_the_largest_measured_m_below() -> None:
    assert pt.bucket_times(pt.DSV4, "bf16", 4000)[0] == 2048  # type: ignore[index]
    assert pt.bucket_times(pt.DSV4, "bf16", 100000)[0] == 8192  # type: ignore[index]
    assert pt.bucket_times(pt.K3, "fp8", 0)[0] == 1  # type: ignore[index]
    assert pt.bucket_times(pt.MoeShape(8, 2, 64, 64), "bf16", 10) is None


def test_fastest_path_picks_the_minimum_among_candidates() -> None:
    best, why = pt.fastest_path(pt.DSV4, "fp8", 8192, ["triton", "deep_gemm_contiguous"])  # type: ignore[misc]
    assert best == "deep_gemm_contiguous" and "8192" in why
    best, _ = pt.fastest_path(pt.DSV4, "fp8", 8192, ["triton", "deep_gemm_masked"])  # type: ignore[misc]
    assert best == "triton"  # masked was not measured there: only triton competes
    assert pt.fastest_path(pt.DSV4, "fp8", 8192, ["nothing"]) is None


def test_mega_guard_only_where_it_measured_slower() -> None:
    assert pt.mega_moe_measured_slower(pt.DSV4, "bf16", 2048) is not None  # 4641 vs 3174
    assert "triton_mega" in (pt.mega_moe_measured_slower(pt.K3, "fp8", 9000) or "")
    assert pt.mega_moe_measured_slower(pt.DSV4, "bf16", 128) is None  # mega 2716 < 2724
    assert pt.mega_moe_measured_slower(pt.K3, "bf16", 128) is None  # not measured: user wins
    assert pt.mega_moe_measured_slower(pt.MoeShape(4, 2, 128, 128), "bf16", 1) is None


def test_deep_gemm_runner_layout_from_measurements() -> None:
    assert measured_layout(pt.DSV4, True, 8192, capturing=False) == "contiguous"
    assert measured_layout(pt.DSV4, True, 8192, capturing=True) == "triton"
    assert measured_layout(pt.DSV4, False, 512, capturing=False) == "triton"
    # unmeasured shapes read the nearest measured one at the same rows an expert
    tp_slice = pt.MoeShape(256, 6, 4096, 1024)  # DSv4 experts sliced over 2 TP ranks
    assert measured_layout(tp_slice, True, 8192, capturing=False) == "contiguous"
    assert measured_layout(tp_slice, True, 8192, capturing=True) == "triton"
    assert measured_layout(pt.MoeShape(6, 3, 256, 256), True, 8192, capturing=False) is not None
    assert measured_layout(pt.DSV4, False, 512, capturing=False, device="Other GPU") == "triton"


def test_nearest_shape_reads_the_same_rows_an_expert() -> None:
    exact = pt.nearest_bucket_times(pt.K3, "fp8", 2048)
    assert exact is not None and exact[0] == pt.K3 and exact[1] == 2048
    half_experts = pt.MoeShape(192, 16, 3584, 3072)  # twice the rows an expert of K3
    near = pt.nearest_bucket_times(half_experts, "fp8", 1024)
    assert near is not None and near[0] == pt.K3 and near[1] == 2048 and near[2] == 2048
    best, why = pt.fastest_path(half_experts, "fp8", 4096, ["triton", "deep_gemm_contiguous"])  # type: ignore[misc]
    assert best == "deep_gemm_contiguous" and "nearest measured shape" in why and "M=8192" in why
    assert pt.nearest_bucket_times(pt.DSV4, "fp16", 8) is None  # nothing measured in fp16


def test_tables_round_trip(tmp_path: Path) -> None:
    buckets = {1: {"triton": 80.0}, 8192: {"triton": 5931.0, "deep_gemm_contiguous": 4038.0}}
    path = pt.write_table(pt.DSV4, "fp8", "NVIDIA H200", buckets, "test", tmp_path)
    assert path.name == "E256_H4096_I2048_top6_fp8_NVIDIA_H200.json"
    assert pt.read_table(path) == (pt.DSV4, "fp8", "NVIDIA H200", buckets)
    stored = pt.load_tables()
    assert {(s, d) for (s, d, _) in stored} >= {(pt.DSV4, "bf16"), (pt.K3, "fp8")}


def test_every_stored_table_loads_and_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    files = sorted(tc.CONFIG_DIR.glob("*.json"))
    assert files, "the H200 tables are stored in the repo"
    for path in files:
        data = json.loads(path.read_text())
        shape = data["shape"]
        if data["dtype"] == MXFP4_KEY:  # the MXFP4 kernel's own tables (tiles per M bucket)
            mx = load_mxfp4_table(path.name)
            assert [m for m, _ in mx] == sorted(b["m"] for b in data["buckets"])
            assert all(mxfp4_config_fits(c, shape["hidden"], shape["inter"]) is None for _, c in mx)
            continue
        buckets = tc.load_table(path.name)
        assert buckets and [b[0] for b in buckets] == sorted(b["m"] for b in data["buckets"])
        for _, kernel, cfg in buckets:
            assert kernel in ("tma", "two_launch")
            if kernel == "tma":
                assert isinstance(cfg, TmaMoeConfig)
                fp8 = data["dtype"] == "fp8"
                assert not tma_config_fits(cfg, shape["hidden"], shape["inter"], fp8, 128)
                assert tc.tma_config_from_dict(tc.tma_config_to_dict(cfg)) == cfg
            elif cfg is not None:  # tuned two-launch tiles
                assert isinstance(cfg, FusedMoeConfig)
                assert tc.two_launch_config_from_dict(tc.two_launch_config_to_dict(cfg)) == cfg
                assert shape["inter"] % cfg.gemm1.block_n == 0


def test_config_dict_keeps_every_field() -> None:
    cfg = TmaMoeConfig(
        128,
        TmaGemmTile(128, 64, 16, 8, 4, persistent=False, warp_specialize=True, paired=True),
        TmaGemmTile(128, 64, 16, 8, 3, rescale=True),
        sorted_a=True,
    )
    assert tc.tma_config_from_dict(json.loads(json.dumps(tc.tma_config_to_dict(cfg)))) == cfg
    # Tables written before a field existed load with its default.
    old = {k: v for k, v in tc.tma_config_to_dict(cfg).items() if k != "sorted_a"}
    assert tc.tma_config_from_dict(old) == TmaMoeConfig(cfg.block_m, cfg.gemm1, cfg.gemm2)


def test_select_reads_the_table_then_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = TmaMoeConfig(64, TmaGemmTile(128, 64, 8, 4, 3), TmaGemmTile(128, 64, 8, 4, 3))
    name = tc.table_name(8, 256, 256, 2, "bf16", "Fake GPU")
    (tmp_path / name).write_text(
        json.dumps(
            {
                "buckets": [
                    {"m": 16, "kernel": "two_launch"},
                    {"m": 512, "kernel": "tma", "config": tc.tma_config_to_dict(cfg)},
                ]
            }
        )
    )
    monkeypatch.setattr(tc, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tc, "_device_name", lambda device: "Fake GPU")
    tc.load_table.cache_clear()
    cpu = torch.device("cpu")
    try:
        pick = tc.select_moe_config(4096, 8, 256, 256, torch.bfloat16, top_k=2, device=cpu)
        assert pick == cfg
        small = tc.select_moe_config(100, 8, 256, 256, torch.bfloat16, top_k=2, device=cpu)
        assert isinstance(small, FusedMoeConfig)
        # A shape the tiles do not divide falls back to the two-launch path.
        monkeypatch.setattr(tc, "table_name", lambda *a: name)
        odd = tc.select_moe_config(4096, 8, 200, 256, torch.bfloat16, top_k=2, device=cpu)
        assert isinstance(odd, FusedMoeConfig)
    finally:
        tc.load_table.cache_clear()


def test_tuned_two_launch_tiles_apply_from_their_bucket_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tuned = FusedMoeConfig(16, GemmTile(16, 128, 1, 4, 5), GemmTile(64, 128, 1, 4, 4))
    name = tc.table_name(8, 256, 256, 2, "bf16", "Fake GPU")
    buckets = [
        {"m": 64, "kernel": "two_launch", "config": tc.two_launch_config_to_dict(tuned)},
        {"m": 256, "kernel": "two_launch"},  # no tiles stored: the rule
    ]
    (tmp_path / name).write_text(json.dumps({"buckets": buckets}))
    monkeypatch.setattr(tc, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tc, "_device_name", lambda device: "Fake GPU")
    tc.load_table.cache_clear()
    cpu = torch.device("cpu")
    try:
        assert tc.select_moe_config(64, 8, 256, 256, torch.bfloat16, top_k=2, device=cpu) == tuned
        assert tc.select_moe_config(200, 8, 256, 256, torch.bfloat16, top_k=2, device=cpu) == tuned
        rule = tc.select_moe_config(300, 8, 256, 256, torch.bfloat16, top_k=2, device=cpu)
        assert rule == get_config(300, 8, 256, 256, torch.bfloat16, top_k=2)
        # Below the smallest bucket the tiles were not measured: the rule decides.
        small = tc.select_moe_config(8, 8, 256, 256, torch.bfloat16, top_k=2, device=cpu)
        assert small == get_config(8, 8, 256, 256, torch.bfloat16, top_k=2) != tuned
    finally:
        tc.load_table.cache_clear()


def test_default_rule_without_a_table() -> None:
    cpu = torch.device("cpu")  # no device name: no table
    decode = tc.select_moe_config(64, 256, 4096, 2048, torch.bfloat16, top_k=6, device=cpu)
    assert isinstance(decode, FusedMoeConfig)
    prefill = tc.select_moe_config(8192, 256, 4096, 2048, torch.bfloat16, top_k=6, device=cpu)
    assert prefill == tc.DEFAULT_TMA_CONFIGS["bf16"]
    fp8 = tc.select_moe_config(8192, 256, 4096, 2048, torch.float8_e4m3fn, top_k=6, device=cpu)
    assert fp8 == tc.DEFAULT_TMA_CONFIGS["fp8"]


if __name__ == "__main__":
    run_this_file(__file__)
