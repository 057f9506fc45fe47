"""ServerArgs: SGLang-compatible flags, defaults resolved from the machine, and invalid
combinations rejected with a message that says what to change."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang.srt.server_args import (
    DEFAULT_MIN_LOGIT_ROWS,
    ServerArgs,
    ServerArgsError,
    build_parser,
    default_max_logit_rows,
    parse_args,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=8)

FLAGS = (
    "--model-path",
    "--tokenizer-path",
    "--tp-size",
    "--tp",
    "--host",
    "--port",
    "--dtype",
    "--device",
    "--enable-symm-mem",
    "--moe-runner-backend",
    "--moe-a2a-backend",
    "--ep-size",
    "--max-running-requests",
    "--max-total-tokens",
    "--chunked-prefill-size",
    "--disable-cuda-graph",
    "--cuda-graph-max-bs",
    "--enable-metrics",
    "--skip-tokenizer-init",
    "--log-level",
    "--random-seed",
    "--dp-size",
    "--enable-dp-attention",
    "--nnodes",
    "--node-rank",
    "--dist-init-addr",
    "--dist-timeout",
)


def test_help_documents_every_flag() -> None:
    text = build_parser().format_help()
    for flag in FLAGS:
        assert flag in text, flag


def test_cli_help_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    assert "--enable-symm-mem" in text and "built-in default model" in text


def test_parse_and_defaults() -> None:
    args = parse_args(["--tp", "2", "--port", "1234", "--enable-metrics"])
    assert (args.tp_size, args.port, args.enable_metrics) == (2, 1234, True)
    assert args.model_path is None and args.host == "127.0.0.1"
    assert ServerArgs().port == 30000
    r = ServerArgs(random_seed=None).resolved()
    assert r.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert r.random_seed is not None and r.chunked_prefill_size is not None
    assert r.resolved() == r  # idempotent
    if r.device == "cpu":
        assert r.dtype == "float32" and r.max_running_requests == 32
    assert r.max_state_snapshots == 2 * r.max_running_requests  # the prefix cache's default
    assert (r.disable_radix_cache, r.schedule_policy) == (False, "fcfs")
    r.validate()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"device": "cpu", "enable_symm_mem": True}, "--enable-symm-mem needs CUDA"),
        ({"device": "cpu", "moe_runner_backend": "triton"}, "--moe-runner-backend auto"),
        ({"tp_size": 0}, "--tp-size must be >= 1"),
        ({"port": 70000}, "--port"),
        ({"chunked_prefill_size": 0}, "-1 to turn chunking off"),
        ({"max_total_tokens": 0}, "--max-total-tokens must be >= 1"),
        ({"model_path": "/nonexistent/model"}, "omit --model-path"),
        ({"moe_a2a_backend": "deepep"}, "--moe-a2a-backend"),
        ({"tp_size": 4, "ep_size": 3}, "--ep-size 3 must divide --tp-size 4"),
        ({"tp_size": 1, "ep_size": 2}, "--ep-size 2 must divide --tp-size 1"),
        (
            {"tp_size": 4, "ep_size": 2, "moe_a2a_backend": "megamoe"},
            "megamoe needs --ep-size equal to --tp-size 4, got 2",
        ),
        ({"ep_size": 0}, "--ep-size must be >= 1"),
        ({"tp_size": 2, "dp_size": 2}, "--dp-size 2 needs --enable-dp-attention"),
        ({"enable_dp_attention": True}, "--enable-dp-attention needs --dp-size > 1"),
        ({"tp_size": 4, "dp_size": 3, "enable_dp_attention": True}, "--dp-size 3 must divide"),
        ({"dp_size": 0}, "--dp-size must be >= 1"),
        ({"nnodes": 2, "node_rank": 2, "tp_size": 2, "dist_init_addr": "h:1"}, "--node-rank"),
        ({"nnodes": 2, "tp_size": 3, "dist_init_addr": "h:1"}, "divisible by --nnodes 2"),
        ({"nnodes": 2, "tp_size": 2}, "--nnodes 2 needs --dist-init-addr"),
        ({"dist_init_addr": "nohost"}, "--dist-init-addr 'nohost': expected HOST:PORT"),
        ({"dist_init_addr": "h:99999"}, "port must be a number in 1..65535"),
        ({"dist_timeout": 0.0}, "--dist-timeout must be > 0"),
        ({"max_logit_rows_per_step": 0}, "--max-logit-rows-per-step must be >= 1, got 0"),
        (
            {"max_running_requests": 64, "max_logit_rows_per_step": 63},
            "--max-logit-rows-per-step 63 is below --max-running-requests 64",
        ),
        ({"schedule_policy": "lifo"}, "--schedule-policy must be one of ('fcfs', 'lpm')"),
        ({"max_state_snapshots": 0}, "--max-state-snapshots must be >= 1, got 0"),
        ({"page_size": 0}, "--page-size must be >= 1, got 0"),
    ],
)
def test_invalid_combinations(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ServerArgsError) as info:
        ServerArgs(**kwargs).resolved().validate()  # type: ignore[arg-type]
    assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("a2a", "ep", "tp", "want"),
    [
        ("none", 1, 1, ("none", 1)),  # one rank: today's path, no new collectives
        ("none", 1, 2, ("none", 1)),  # TP without --ep-size stays tensor parallel
        ("none", 2, 2, ("ep", 2)),  # --ep-size selects the all-to-all backend
        ("ep", 1, 2, ("ep", 2)),  # a named ep spans the TP group
        ("none", 2, 4, ("ep", 2)),  # experts over 2 ranks, each TP-sliced over 2 (E < T)
        ("ep", 2, 8, ("ep", 2)),
        ("ep", 1, 1, ("none", 1)),  # ep on one rank is the plain layer
        ("megamoe", 2, 2, ("megamoe", 2)),
        ("megamoe", 1, 2, ("megamoe", 2)),
    ],
)
def test_expert_parallel_resolution(a2a: str, ep: int, tp: int, want: tuple[str, int]) -> None:
    args = ServerArgs(device="cpu", moe_a2a_backend=a2a, ep_size=ep, tp_size=tp).resolved()
    assert (args.moe_a2a_backend, args.ep_size) == want
    assert args.resolved() == args
    args.validate()
    parsed = parse_args(["--ep-size", str(ep), "--tp-size", str(tp)])
    assert parsed.ep_size == ep


def test_multi_node_layout() -> None:
    args = parse_args(
        ["--tp", "4", "--dp", "2", "--enable-dp-attention", "--nnodes", "2", "--node-rank", "1"]
        + ["--dist-init-addr", "[::1]:5000"]
    )
    assert list(args.local_ranks) == [2, 3] and args.attn_tp_size == 2
    assert args.dist_init_host_port() == ("::1", 5000)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_requested_without_gpu() -> None:
    with pytest.raises(ServerArgsError, match="--device cpu"):
        ServerArgs(device="cuda").resolved().validate()


def test_launch_fails_fast_on_bad_combination() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--device", "cpu", "--enable-symm-mem"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--enable-symm-mem needs CUDA" in out.stderr


def test_launch_fails_fast_without_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4"}')
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--device",
            "cpu",
            "--model-path",
            str(tmp_path),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "no tokenizer.json" in out.stderr and "--skip-tokenizer-init" in out.stderr


def test_max_logit_rows_default_and_flag() -> None:
    """Default: one row per running request and at least DEFAULT_MIN_LOGIT_ROWS; the flag wins."""
    assert ServerArgs(max_running_requests=32).resolved().max_logit_rows_per_step == 512
    assert ServerArgs(max_running_requests=600).resolved().max_logit_rows_per_step == 600
    assert default_max_logit_rows(8) == DEFAULT_MIN_LOGIT_ROWS
    args = parse_args(["--max-running-requests", "16", "--max-logit-rows-per-step", "16"])
    assert args.resolved().max_logit_rows_per_step == 16
    args.resolved().validate()


def test_chunking_off_accepted() -> None:
    ServerArgs(chunked_prefill_size=-1).resolved().validate()
    assert not ServerArgs(chunked_prefill_size=-1).chunked_prefill_enabled


if __name__ == "__main__":
    run_this_file(__file__)
