"""``RouteFollower`` (the graph tests' router-flip guard): a followed call takes the recorded
experts, with the weights ``select_experts`` gives those ids, only where its own choice differs
from them at a near-tie; a larger gap fails, and a call with nothing recorded fails."""

from __future__ import annotations

import types

import pytest
import torch

from sglang.srt.layers.moe.topk import TopKConfig, select_experts
from sglang.test.ci_register import register_cpu_ci
from sglang.test.decode_drift import NEAR_TIE, RouteFollower
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)

CONFIG = TopKConfig(top_k=2, scoring_func="sigmoid", renormalize=True)


def _module() -> types.ModuleType:
    module = types.ModuleType("fake_moe")
    module.select_experts = select_experts  # type: ignore[attr-defined]
    return module


def _logits(gap: float) -> torch.Tensor:
    """One token over 5 experts: expert 0 best, experts 1 and 2 apart by ``gap`` in score."""
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(1, 5, generator=g) * 0.2 + 0.05  # all below the top three
    scores[0, :3] = torch.tensor([0.9, 0.6 + gap, 0.6])
    return torch.logit(scores)  # sigmoid(logit(s)) == s


def test_follows_a_near_tie_with_the_weights_select_experts_gives() -> None:
    module = _module()
    with RouteFollower(module) as routes:
        routes.record()
        recorded = module.select_experts(_logits(-NEAR_TIE / 2), CONFIG)  # picks 0 and 2
        routes.follow()
        own = select_experts(_logits(NEAR_TIE / 2), CONFIG)  # on its own it picks 0 and 1
        got = module.select_experts(_logits(NEAR_TIE / 2), CONFIG)
    assert sorted(recorded.topk_ids[0].tolist()) == [0, 2]
    assert sorted(own.topk_ids[0].tolist()) == [0, 1]
    assert got.topk_ids.tolist() == recorded.topk_ids.tolist()
    scores = torch.sigmoid(_logits(NEAR_TIE / 2))[0, got.topk_ids[0].long()]
    torch.testing.assert_close(got.topk_weights[0], scores / scores.sum(), rtol=1e-5, atol=1e-6)
    assert len(routes.gaps) == 1 and 0 < routes.gaps[0] <= NEAR_TIE
    assert module.select_experts is select_experts  # restored on exit


def test_a_gap_past_the_near_tie_fails_and_nothing_recorded_fails() -> None:
    module = _module()
    with RouteFollower(module) as routes:
        routes.record()
        module.select_experts(_logits(-0.1), CONFIG)
        routes.follow()
        with pytest.raises(AssertionError, match="gap 1.00e-01"):
            module.select_experts(_logits(0.1), CONFIG)
        with pytest.raises(AssertionError, match="no recorded choice"):
            module.select_experts(_logits(0.1), CONFIG)
        routes.off()  # off: the router's own choice
        assert sorted(module.select_experts(_logits(0.1), CONFIG).topk_ids[0].tolist()) == [0, 1]


if __name__ == "__main__":
    run_this_file(__file__)
