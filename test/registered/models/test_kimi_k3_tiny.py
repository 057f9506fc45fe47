"""Checks of the tiny Kimi K3 set-up of the test kit (``sglang.test.kimi_k3_tiny``): the configs
parse as intended and the randomisation leaves no parameter at its initial value."""

from __future__ import annotations

import torch

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.test.ci_register import register_cpu_ci
from sglang.test.kimi_k3_tiny import (
    CONFIG_A,
    CONFIG_B,
    CONFIG_C,
    VOCAB,
    config,
    make_model,
    randomize_,
    tokens,
)
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)


# --- checks of the set-up ------------------------------------------------------------------------


def test_configs_parse_as_intended() -> None:
    a, b, c = config(CONFIG_A), config(CONFIG_B), config(CONFIG_C)
    assert a.layer_kinds == ("kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla")
    assert b.layer_kinds == ("mla", "kda", "kda", "kda", "kda", "mla", "mla")
    assert [a.is_moe(i) for i in range(8)] == [False] + [True] * 7
    assert a.num_bank_rows == 3 and b.num_bank_rows == 2 and c.attn_res_block_size is None
    assert a.kda_gate_lower_bound == -5.0 and b.kda_gate_lower_bound is None
    assert a.num_expert_group is None  # one group is a no-op


def test_randomisation_touches_every_parameter() -> None:
    fresh = KimiK3ForCausalLM(
        config(CONFIG_A), LayerBuildSpec(dtype=torch.float32, moe_runner="torch")
    )
    # A sentinel first: uninitialised parameters may reuse freed memory that an earlier test's
    # identical randomisation filled, and would then compare equal after randomize_.
    with torch.no_grad():
        for p in fresh.parameters():
            p.fill_(12345.0)
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    randomize_(fresh, seed=1)
    same = [n for n, p in fresh.named_parameters() if torch.equal(p, before[n])]
    assert same == []


def test_forward_is_finite() -> None:
    for raw in (CONFIG_A, CONFIG_B, CONFIG_C):
        model = make_model(raw, seed=2)
        ids = tokens(11, seed=3)
        logits = model(ids, torch.arange(11))
        assert (
            logits.shape == (11, VOCAB)
            and logits.dtype == torch.float32
            and torch.isfinite(logits).all()
        )


if __name__ == "__main__":
    run_this_file(__file__)
