"""Kimi K3's memory model (``mem_cache/memory_models/kimi_k3.py``, from
``KimiK3ForCausalLM.memory_model()``) against what its pools really allocate, on the tiny configs
(AttnRes or plain residuals; fp32 or bf16 model and KDA state; one rank or this rank's half of the
KDA heads):

- the slot pool (the eager and the static decode both use it) as ``init_decode`` sizes it for N
  running requests and a budget of T tokens: ``pool.nbytes()`` is exactly the model's fixed bytes
  (N slots, the scratch slot, their block-table rows, the null block) plus the per-token bytes of
  the pool's blocks, and a slot's KDA states are the model's per-request bytes. Against the
  budget itself (fixed bytes for the context, T tokens) it differs only by the pool's rounding of
  T to whole blocks (less than one block of latents) and its table rows being as wide as the
  longest request rather than the context (8 bytes a block of the difference a slot);
- the workspace: DeepSeek V4's per-layer temporaries on a ``hidden``-wide stream plus the AttnRes
  bank, whose rows (counted in a forward) are the ones the model reserves for.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang.srt.layers.attn_res import AttnResState
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.mem_cache.kimi_k3_cache import KDAState, KimiK3RequestCache
from sglang.srt.mem_cache.memory_models.kimi_k3 import KimiK3MemoryModel
from sglang.srt.mem_cache.memory_models.workspace import ACTIVATION_COPIES
from sglang.srt.model_executor.slot_plan import plan_slot_pool
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.test.ci_register import register_cpu_ci
from sglang.test.kimi_k3_tiny import CONFIG_A, CONFIG_B, CONFIG_C, config, make_model, tokens
from sglang.test.run import run_this_file

register_cpu_ci(est_time=4)

BF16_STATE: dict[str, Any] = {**CONFIG_B, "mamba_ssm_dtype": "bfloat16"}
# (config, model dtype, tp size): fp32 everything; bf16 model with bf16 KDA state; bf16 model
# with the fp32 state on one of two ranks (half the KDA heads); plain residuals.
CASES = [
    (CONFIG_A, torch.float32, 1),
    (BF16_STATE, torch.bfloat16, 1),
    (CONFIG_A, torch.bfloat16, 2),
    (CONFIG_C, torch.float32, 1),
]
IDS = ["a-fp32", "b-bf16-state", "a-bf16-tp2", "c-fp32"]
# (running requests, context, budget tokens): whole blocks; a part block; a budget below one
# request's whole blocks (the pool still takes them); a context wider than the budget.
SIZES = [(4, 300, 2048), (3, 1000, 1300), (2, 1000, 700), (5, 4096, 1024)]


def _model(raw: dict[str, Any], dtype: torch.dtype, tp: int) -> KimiK3ForCausalLM:
    spec = LayerBuildSpec(dtype=dtype, moe_runner="torch", tp_rank=0, tp_size=tp)
    return KimiK3ForCausalLM(config(raw), spec)


def _kda_bytes(cache: KimiK3RequestCache) -> int:
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        if isinstance(layer, KDAState)
        for t in (layer.conv, layer.recurrent)
    )


@pytest.mark.parametrize(("raw", "dtype", "tp"), CASES, ids=IDS)
def test_the_slot_pool_allocates_what_the_memory_model_says(
    raw: dict[str, Any], dtype: torch.dtype, tp: int
) -> None:
    model = _model(raw, dtype, tp)
    mm = model.memory_model()
    c = model.config
    assert mm.pool.kda_heads == c.kda_num_heads // tp and mm.num_mla == c.layer_kinds.count("mla")
    token = mm.bytes_per_cached_token()
    assert token == c.layer_kinds.count("mla") * (c.kv_lora_rank + c.qk_rope_head_dim) * (
        dtype.itemsize
    )
    for n, context, total in SIZES:
        plan = plan_slot_pool(
            context_length=context, max_total_tokens=total, max_running_requests=n
        )
        pool = model.enable_slot_pool(plan.slots, plan.capacity, total_tokens=plan.total_tokens)
        assert pool.block_tokens == mm.block_tokens and pool.shape == mm.pool
        pooled = pool.block_pool.num_blocks * pool.block_tokens
        exact = mm.fixed_bytes(n, plan.capacity) + int(token) * pooled
        assert pool.nbytes() == exact, (n, context, total)
        cache = model.new_pooled_cache()
        assert _kda_bytes(cache) == mm.request_state_bytes()
        model.free_pooled_cache(cache)
        # The budget's view: fixed bytes for the whole context and exactly T tokens.
        estimate = mm.fixed_bytes(n, context) + token * total
        table_gap = (n + 1) * (mm.table_row_bytes(context) - mm.table_row_bytes(plan.capacity))
        slack = (mm.block_tokens - 1) * token + table_gap
        assert abs(estimate - pool.nbytes()) <= slack, (n, context, total)


@pytest.mark.parametrize("raw", [CONFIG_A, CONFIG_C], ids=["attn-res", "plain"])
def test_the_workspace_counts_the_attn_res_bank_a_forward_holds(
    raw: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(raw, seed=5)
    mm = model.memory_model()
    writes: list[int] = []
    real = AttnResState.write_bank

    def counted(state: AttnResState) -> None:
        writes.append(1)
        real(state)

    monkeypatch.setattr(AttnResState, "write_bank", counted)
    model(tokens(5, seed=6), torch.arange(5))
    assert mm.bank_rows == len(writes)  # the bank's rows at the last read
    h, t = model.config.hidden_size, 40
    base = t * h * 4 * ACTIVATION_COPIES
    # The bank and the partial sum in the model dtype, a read's stacked copy twice in fp32.
    bank = 0 if not writes else t * h * (len(writes) + 1) * (4 + 8)
    assert mm.activation_bytes(t) == base + bank
    assert mm.workspace_bytes(t, 3) == base + bank + 3 * model.config.vocab_size * 8


def test_bad_sizes_are_refused_by_name() -> None:
    mm = _model(CONFIG_A, torch.float32, 1).memory_model()
    with pytest.raises(ValueError, match="block tokens 0 must be >= 1"):
        KimiK3MemoryModel(**{**mm.__dict__, "block_tokens": 0})


if __name__ == "__main__":
    run_this_file(__file__)
