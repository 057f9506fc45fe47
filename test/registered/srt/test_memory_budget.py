"""The default --max-total-tokens on a GPU: cached-token cost of DeepSeek V4's compressed layers,
the fixed window and workspace costs (logits for --max-logit-rows-per-step rows, not the whole
chunk), the cap, the startup log's note, and an actionable error when nothing fits. The memory
model is the model's own (``memory_model()``): DeepSeek V4's is its CacheShape (the same numbers
as before), Kimi K3's budget on a (faked) GPU is a real bound from its memory model, and a model
without one falls back to the worst case with a warning."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.default_model.config import default_model_config
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.model_executor.memory_budget import (
    CacheShape,
    MemoryBudgetError,
    logits_reservation_note,
    max_total_tokens_for_memory,
    unbounded_budget_reason,
)
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_config import DeepseekV4ModelConfig
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.kimi_k3_tiny import CONFIG_A as KIMI_CONFIG
from sglang.test.kimi_k3_tiny import config as kimi_config
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)

GIB = 1 << 30

# A tiny DeepSeek V4 config (the keys the memory model reads) and its cache shape in bf16, as
# DeepseekV4ForCausalLM's memory_model() gives it (test_deepseek_v4_offers_its_cache_shape).
CONFIG = SimpleNamespace(
    num_hidden_layers=3,
    hidden_size=64,
    hc_mult=2,
    vocab_size=100,
    head_dim=32,
    index_head_dim=16,
    sliding_window=8,
    compress_ratios=[0, 4, 128],
    attn_types=["sliding", "csa", "hca"],
)
SHAPE = CacheShape.from_model_config(CONFIG, 2)


def test_costs() -> None:
    assert SHAPE.bytes_per_cached_token() == pytest.approx(32 * 2 / 4 + 16 * 2 / 4 + 32 * 2 / 128)
    assert SHAPE.window_bytes_per_request() == 3 * 8 * 32 * 2
    # Logits (fp32, twice: logits and the sampler's copy) by logit rows; activations by tokens.
    assert SHAPE.logits_bytes(3) == 3 * 100 * 4 * 2
    assert SHAPE.activation_bytes(10) == 10 * 64 * 2 * 4 * 32
    assert SHAPE.workspace_bytes(10, 3) == 10 * 64 * 2 * 4 * 32 + 3 * 100 * 8


def test_budget_and_cap() -> None:
    fixed = SHAPE.workspace_bytes(16 + 4, 5) + 4 * SHAPE.window_bytes_per_request()
    room = fixed + 24_500
    common = {"room_bytes": room, "max_running_requests": 4, "chunked_prefill_size": 16}
    got = max_total_tokens_for_memory(SHAPE, **common, context_length=10**6, max_logit_rows=5)
    assert got == int(24_500 // SHAPE.bytes_per_cached_token())
    capped = max_total_tokens_for_memory(SHAPE, **common, context_length=100, max_logit_rows=5)
    assert capped == 400
    # Each logit row fewer is vocab x 8 bytes more for cached tokens.
    fewer = max_total_tokens_for_memory(SHAPE, **common, context_length=10**6, max_logit_rows=4)
    assert fewer == int((24_500 + 100 * 8) // SHAPE.bytes_per_cached_token())
    with pytest.raises(ValueError, match="max_logit_rows must be >= 1"):
        max_total_tokens_for_memory(SHAPE, **common, context_length=100, max_logit_rows=0)


def test_dsv4_logits_reservation() -> None:
    """DeepSeek V4's vocabulary, an 8192-token chunk and 256 running requests: the default cap
    (512 rows) reserves 0.49 GiB of logits, where every row of the chunk and the decodes took
    8.14 GiB; the note says both and names the flag."""
    dsv4 = CacheShape(
        num_layers=61,
        hidden_size=7168,
        hc_mult=4,
        vocab_size=129280,
        head_dim=512,
        index_head_dim=128,
        sliding_window=128,
        compress_ratios=(4, 128),
        attn_types=("csa", "hca"),
        dtype_bytes=2,
    )
    assert dsv4.logits_bytes(512) == 512 * 129280 * 8
    assert dsv4.logits_bytes(8192 + 256) == (8192 + 256) * 129280 * 8
    note = logits_reservation_note(
        dsv4, logit_rows=512, chunked_prefill_size=8192, max_running_requests=256
    )
    assert "0.49 GiB reserved for the fp32 logits of 512 rows" in note, note
    assert "--max-logit-rows-per-step" in note and "not 8.14 GiB" in note, note


def test_not_enough_memory_says_what_to_change() -> None:
    with pytest.raises(MemoryBudgetError, match="--max-logit-rows-per-step") as info:
        max_total_tokens_for_memory(
            SHAPE,
            room_bytes=1000,
            max_running_requests=4,
            chunked_prefill_size=16,
            context_length=64,
            max_logit_rows=4,
        )
    assert "--max-running-requests" in str(info.value) and "logits of 4 rows" in str(info.value)


@pytest.mark.parametrize("dp", [1, 2])
def test_startup_budget_reserves_the_caps_rows_and_logs_it(
    dp: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduler process's default budget on a (faked) GPU passes the cap, times the DP
    groups whose rows rank 0 gathers, to the memory model, and rank 0 logs the reservation."""
    from sglang.srt.managers import scheduler_process
    from sglang.srt.server_args import ServerArgs

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))
    # A model offering the DeepSeek V4 cache shape of CONFIG.
    model = SimpleNamespace(config=CONFIG, memory_model=lambda: SHAPE)
    runner = SimpleNamespace(device=torch.device("cuda"), model=model, dtype=torch.bfloat16)
    args = ServerArgs(
        device="cpu",
        max_running_requests=4,
        chunked_prefill_size=16,
        max_logit_rows_per_step=6,
        tp_size=dp,
        dp_size=dp,
        enable_dp_attention=dp > 1,
        mem_fraction_static=0.5,
    ).resolved()
    with caplog.at_level(logging.INFO, logger="sglang"):
        got = scheduler_process._default_max_total_tokens(args, runner, 10**9, log=True)
        scheduler_process._default_max_total_tokens(args, runner, 10**9, log=False)
    want = max_total_tokens_for_memory(
        SHAPE,
        room_bytes=40 * gib - 20 * gib,
        max_running_requests=4,
        chunked_prefill_size=16,
        context_length=10**9,
        max_logit_rows=6 * dp,
        state_snapshots=8,  # the prefix cache's default: two a running request
    )
    assert got == want
    assert got != max_total_tokens_for_memory(
        SHAPE,
        room_bytes=20 * gib,
        max_running_requests=4,
        chunked_prefill_size=16,
        context_length=10**9,
        max_logit_rows=20,  # every row of the chunk and the decodes
    )
    lines = [r.getMessage() for r in caplog.records if "memory budget:" in r.getMessage()]
    assert len(lines) == 1 and f"logits of {6 * dp} rows" in lines[0], lines
    assert ("DP groups" in lines[0]) == (dp > 1)


def test_deepseek_v4_offers_its_cache_shape() -> None:
    """The built-in DeepSeek V4 config: the model's memory model is the CacheShape the budget
    used before there were memory models, with the same numbers."""
    cfg = DeepseekV4ModelConfig.from_dict(default_model_config(256, 1, 2))
    model = DeepseekV4ForCausalLM(cfg, LayerBuildSpec(dtype=torch.bfloat16, moe_runner="torch"))
    got = model.memory_model()
    assert got == CacheShape(
        num_layers=4,
        hidden_size=128,
        hc_mult=4,
        vocab_size=256,
        head_dim=64,
        index_head_dim=32,
        sliding_window=32,
        compress_ratios=(0, 4, 128, 4),
        attn_types=("sliding", "csa", "hca", "csa"),
        dtype_bytes=2,
    )
    assert got.bytes_per_cached_token() == 2 * (64 * 2 / 4 + 32 * 2 / 4) + 64 * 2 / 128
    assert got.fixed_bytes(3, 10**6) == 3 * got.window_bytes_per_request() == 3 * 4 * 32 * 64 * 2
    assert got.workspace_bytes(10, 3) == 10 * 128 * 4 * 4 * 32 + 3 * 256 * 8
    # A state snapshot: the window rings, and the ratio-4 layers' fp32 previous-block rows
    # (kv and score, [4, D] each) of the compressor and of the indexer.
    overlap = 2 * (2 * 4 * (64 + 32) * 4)
    assert got.snapshot_bytes() == got.window_bytes_per_request() + overlap


def _args(**kw: object) -> ServerArgs:
    base: dict[str, object] = {
        "device": "cpu",
        "max_running_requests": 4,
        "chunked_prefill_size": 16,
        "max_logit_rows_per_step": 6,
        "mem_fraction_static": 0.5,
    }
    return ServerArgs(**{**base, **kw}).resolved()  # type: ignore[arg-type]


def test_kimi_k3_budget_is_a_bound_from_its_memory_model(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Kimi K3 on a (faked) GPU with 10 MiB left in the share: the default budget is what its
    memory model fits there, far below the worst case, and rank 0 says so in one line."""
    from sglang.srt.managers import scheduler_process

    free = 40 * GIB + 10 * (1 << 20)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 80 * GIB))
    model = KimiK3ForCausalLM(
        kimi_config(KIMI_CONFIG), LayerBuildSpec(dtype=torch.bfloat16, moe_runner="torch")
    )
    cuda = torch.device("cuda")
    runner = SimpleNamespace(device=cuda, model=model, dtype=torch.bfloat16)
    args, context = _args(), 10**6
    with caplog.at_level(logging.INFO, logger="sglang"):
        got = scheduler_process._default_max_total_tokens(args, runner, context, log=True)
    shape = model.memory_model()
    want = max_total_tokens_for_memory(
        shape,
        room_bytes=10 * (1 << 20),
        max_running_requests=4,
        chunked_prefill_size=16,
        context_length=context,
        max_logit_rows=6,
        state_snapshots=8,
    )
    left = 10 * (1 << 20) - shape.workspace_bytes(20, 6) - shape.fixed_bytes(4, context)
    left -= 8 * shape.snapshot_bytes()  # the prefix cache's snapshots: a request's KDA states
    assert shape.snapshot_bytes() == shape.request_state_bytes()
    assert _args(disable_radix_cache=True).max_state_snapshots == 8  # resolved, but unused:
    no_cache = scheduler_process._default_max_total_tokens(
        _args(disable_radix_cache=True), runner, context, log=False
    )
    assert no_cache > got
    assert got == want == int(left // shape.bytes_per_cached_token()) < context * 4
    assert unbounded_budget_reason(model, cuda) is None
    lines = [
        r.getMessage() for r in caplog.records if "default --max-total-tokens" in r.getMessage()
    ]
    assert len(lines) == 1, lines
    assert (
        f"default --max-total-tokens {got}: KimiK3ForCausalLM's memory model, Kimi K3:"
        in (lines[0])
    )
    assert "2 MLA layers' 40-wide latents" in lines[0] and "6 KDA layers'" in lines[0], lines[0]


def test_a_model_without_memory_model_gets_the_worst_case_and_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.managers import scheduler_process

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GIB, 80 * GIB))
    cuda = torch.device("cuda")
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=100))
    runner = SimpleNamespace(
        device=cuda, model=model, dtype=torch.bfloat16, entry=SimpleNamespace(architecture="X")
    )
    with caplog.at_level(logging.WARNING, logger="sglang"):
        got = scheduler_process._default_max_total_tokens(_args(), runner, 1000, log=True)
    assert got == 1000 * 4
    assert any("no memory model for X" in r.getMessage() for r in caplog.records)
    assert unbounded_budget_reason(model, cuda) == "SimpleNamespace has no memory model"
    # On CPU there is nothing to measure: the worst case, whatever the model.
    k3 = KimiK3ForCausalLM(kimi_config(KIMI_CONFIG), LayerBuildSpec(moe_runner="torch"))
    why = unbounded_budget_reason(k3, torch.device("cpu"))
    assert why == "on cpu there is no GPU memory to measure"


if __name__ == "__main__":
    run_this_file(__file__)
