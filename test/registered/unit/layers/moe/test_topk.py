"""MoE routing against a deliberately plain float64 reference: one Python loop per token."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import FrozenInstanceError

import numpy as np
import pytest
import torch

from sglang.srt.layers.moe.topk import (
    TopKConfig,
    TopKOutput,
    hash_select_experts,
    select_experts,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=5)

SCORING = ("softmax", "sigmoid", "sqrtsoftplus")


# --- reference ---------------------------------------------------------------------------------


def _ref_scores(row: list[float], scoring: str) -> list[float]:
    if scoring == "softmax":
        top = max(row)
        exps = [math.exp(x - top) for x in row]
        total = sum(exps)
        return [e / total for e in exps]
    if scoring == "sigmoid":
        return [1.0 / (1.0 + math.exp(-x)) for x in row]
    if scoring == "sqrtsoftplus":
        return [math.sqrt(math.log1p(math.exp(x))) for x in row]
    raise AssertionError(scoring)


def _ref_finish(weights: list[float], cfg: TopKConfig) -> list[float]:
    if cfg.renormalize:
        total = sum(weights)
        weights = [w / total for w in weights]
    if cfg.apply_routed_scaling:
        weights = [w * cfg.routed_scaling_factor for w in weights]
    return weights


def _ref_arrays(
    ids: list[list[int]], weights: list[list[float]], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The reference's per-token choices as ``[T, k]`` arrays: int64 ids, float64 weights."""
    return (
        np.array(ids, dtype=np.int64).reshape(-1, k),
        np.array(weights, dtype=np.float64).reshape(-1, k),
    )


def _ref_route(
    logits: torch.Tensor, cfg: TopKConfig, bias: torch.Tensor | None = None
) -> tuple[np.ndarray, np.ndarray]:
    rows = logits.double().tolist()
    b = [0.0] * logits.shape[1] if bias is None else bias.double().tolist()
    all_ids, all_w = [], []
    for row in rows:
        num_experts = len(row)
        s = _ref_scores(row, cfg.scoring_func)
        choice = [s[e] + b[e] for e in range(num_experts)]
        allowed = list(range(num_experts))
        if cfg.num_expert_group is not None:
            size = num_experts // cfg.num_expert_group
            group_score = []
            for g in range(cfg.num_expert_group):
                members = sorted(choice[g * size : (g + 1) * size], reverse=True)
                group_score.append(sum(members[:2]))
            best_groups = sorted(range(cfg.num_expert_group), key=lambda g: -group_score[g])
            kept = set(best_groups[: cfg.topk_group])
            allowed = [e for e in allowed if e // size in kept]
        ids = sorted(allowed, key=lambda e: -choice[e])[: cfg.top_k]
        all_ids.append(ids)
        all_w.append(_ref_finish([s[e] for e in ids], cfg))
    return _ref_arrays(all_ids, all_w, cfg.top_k)


def _check(out: TopKOutput, ref: tuple[np.ndarray, np.ndarray]) -> None:
    ref_ids, ref_w = ref
    assert out.topk_ids.dtype == torch.int32
    assert out.topk_weights.dtype == torch.float32
    np.testing.assert_array_equal(out.topk_ids.numpy(), ref_ids)
    np.testing.assert_allclose(out.topk_weights.double().numpy(), ref_w, rtol=2e-6, atol=1e-7)


def _logits(t: int, e: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, e, generator=g) * scale


def _bias(e: int, seed: int, scale: float = 0.3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(e, generator=g) * scale


def _route_and_check(
    cfg: TopKConfig, tokens: int, seed: int, with_bias: bool
) -> tuple[TopKOutput, torch.Tensor, torch.Tensor | None]:
    """``select_experts`` on fresh random logits over 32 experts (and a random correction bias),
    checked against the reference. -> (its output, the logits, the bias)."""
    logits = _logits(tokens, 32, seed=seed)
    bias = _bias(32, seed=seed) if with_bias else None
    out = select_experts(logits, cfg, bias)
    _check(out, _ref_route(logits, cfg, bias))
    return out, logits, bias


# --- select_experts ------------------------------------------------------------------------------


@pytest.mark.parametrize("scoring", SCORING)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("apply_scaling", [False, True])
def test_matches_reference(
    scoring: str, with_bias: bool, renormalize: bool, apply_scaling: bool
) -> None:
    cfg = TopKConfig(
        top_k=6,
        scoring_func=scoring,  # type: ignore[arg-type]
        renormalize=renormalize,
        routed_scaling_factor=2.5,
        apply_routed_scaling=apply_scaling,
    )
    out, _, _ = _route_and_check(cfg, 41, seed=7, with_bias=with_bias)
    assert out.topk_weights.shape == (41, 6) and out.topk_ids.shape == (41, 6)


@pytest.mark.parametrize("scoring", SCORING)
@pytest.mark.parametrize("with_bias", [False, True])
def test_group_limited_matches_reference_and_changes_selection(
    scoring: str, with_bias: bool
) -> None:
    grouped = TopKConfig(
        top_k=4,
        scoring_func=scoring,  # type: ignore[arg-type]
        num_expert_group=8,
        topk_group=2,
        routed_scaling_factor=1.5,
        apply_routed_scaling=True,
    )
    out, logits, bias = _route_and_check(grouped, 64, seed=11, with_bias=with_bias)
    groups_used = (out.topk_ids.long() // 4).tolist()
    assert all(len(set(row)) <= 2 for row in groups_used)
    flat = TopKConfig(top_k=4, scoring_func=scoring)  # type: ignore[arg-type]
    assert not torch.equal(select_experts(logits, flat, bias).topk_ids, out.topk_ids), (
        "group limiting must change some token's selection on this input"
    )


def test_group_score_is_sum_of_top_two_not_max() -> None:
    # Group 0 holds the single best expert; group 1's top two sum higher. One kept group.
    cfg = TopKConfig(
        top_k=1, scoring_func="sigmoid", renormalize=False, num_expert_group=2, topk_group=1
    )
    logits = torch.tensor([[3.0, -4.0, -3.5, 2.0, 1.9, -5.0]])
    out = select_experts(logits, cfg)
    assert out.topk_ids.tolist() == [[3]]
    _check(out, _ref_route(logits, cfg))


def test_one_group_is_a_no_op() -> None:
    logits = _logits(16, 24, seed=3)
    bias = _bias(24, seed=3)
    plain = select_experts(logits, TopKConfig(top_k=5, scoring_func="sigmoid"), bias)
    one = select_experts(
        logits,
        TopKConfig(top_k=5, scoring_func="sigmoid", num_expert_group=1, topk_group=1),
        bias,
    )
    assert torch.equal(plain.topk_ids, one.topk_ids)
    assert torch.equal(plain.topk_weights, one.topk_weights)


@pytest.mark.parametrize("scoring", SCORING)
def test_bias_steers_selection_but_weights_stay_unbiased(scoring: str) -> None:
    # Expert 0 scores best, but a large bias on expert 2 wins the selection.
    logits = torch.tensor([[2.1, 0.7, -0.4, 1.3]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    raw = TopKConfig(top_k=1, scoring_func=scoring, renormalize=False)  # type: ignore[arg-type]
    unbiased = select_experts(logits, raw)
    biased = select_experts(logits, raw, bias)
    assert unbiased.topk_ids.tolist() == [[0]]
    assert biased.topk_ids.tolist() == [[2]]
    s = _ref_scores(logits[0].double().tolist(), scoring)
    assert biased.topk_weights.item() == pytest.approx(s[2], rel=1e-6)
    assert biased.topk_weights.item() < 1.0, "the bias must not leak into the weight"

    two = TopKConfig(top_k=2, scoring_func=scoring)  # type: ignore[arg-type]
    out = select_experts(logits, two, bias)
    assert out.topk_ids.tolist() == [[2, 0]]
    want = [s[2] / (s[2] + s[0]), s[0] / (s[2] + s[0])]
    np.testing.assert_allclose(out.topk_weights[0].double().numpy(), want, rtol=1e-6)


def test_softmax_without_renorm_keeps_probabilities_over_all_experts() -> None:
    logits = _logits(9, 16, seed=5)
    out = select_experts(logits, TopKConfig(top_k=3, scoring_func="softmax", renormalize=False))
    probs = torch.softmax(logits.double(), dim=-1)
    want = probs.gather(1, out.topk_ids.long())
    np.testing.assert_allclose(out.topk_weights.double().numpy(), want.numpy(), rtol=1e-6)
    assert (out.topk_weights.sum(-1) < 1.0 - 1e-3).all()


def test_routed_scaling_only_when_applied() -> None:
    logits = _logits(12, 16, seed=9)
    base = TopKConfig(top_k=4, scoring_func="sigmoid", routed_scaling_factor=1.5)
    kept = select_experts(logits, base)
    applied = select_experts(logits, dataclasses.replace(base, apply_routed_scaling=True))
    torch.testing.assert_close(kept.topk_weights.sum(-1), torch.ones(12))
    torch.testing.assert_close(applied.topk_weights, kept.topk_weights * 1.5)


def test_bf16_logits_are_cast_to_fp32() -> None:
    logits = _logits(20, 32, seed=13).to(torch.bfloat16)
    bias = _bias(32, seed=13)
    cfg = TopKConfig(top_k=6, scoring_func="sqrtsoftplus")
    out = select_experts(logits, cfg, bias)
    _check(out, _ref_route(logits.float(), cfg, bias))


def test_empty_batch() -> None:
    cfg = TopKConfig(top_k=4, scoring_func="sigmoid", num_expert_group=4, topk_group=2)
    out = select_experts(torch.empty(0, 16), cfg, _bias(16, seed=1))
    assert out.topk_weights.shape == (0, 4) and out.topk_weights.dtype == torch.float32
    assert out.topk_ids.shape == (0, 4) and out.topk_ids.dtype == torch.int32


def test_ties_are_deterministic_and_distinct() -> None:
    logits = torch.full((5, 8), 0.37)
    cfg = TopKConfig(top_k=3, scoring_func="sigmoid")
    first = select_experts(logits, cfg)
    second = select_experts(logits.clone(), cfg)
    assert torch.equal(first.topk_ids, second.topk_ids)
    assert all(len(set(row)) == 3 for row in first.topk_ids.tolist())
    torch.testing.assert_close(first.topk_weights, torch.full((5, 3), 1.0 / 3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 0}, "top_k must be a positive int"),
        ({"top_k": 2.0}, "top_k must be a positive int"),
        ({"scoring_func": "relu"}, "scoring_func='relu' is not supported"),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor must be a finite number > 0"),
        ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
        ({"num_expert_group": 4}, "must be set together"),
        ({"topk_group": 2}, "must be set together"),
        (
            {"num_expert_group": 4, "topk_group": 5},
            r"topk_group must be in \[1, num_expert_group=4\]",
        ),
        ({"num_expert_group": 4, "topk_group": 0}, "topk_group must be in"),
        ({"num_expert_group": 0, "topk_group": 0}, "num_expert_group must be >= 1"),
    ],
)
def test_config_validation(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"top_k": 2, "scoring_func": "sigmoid"}
    with pytest.raises(ValueError, match=match):
        TopKConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    cfg = TopKConfig(top_k=2, scoring_func="sigmoid")
    with pytest.raises(FrozenInstanceError):
        cfg.top_k = 3  # type: ignore[misc]


def test_call_time_errors() -> None:
    cfg = TopKConfig(top_k=4, scoring_func="sigmoid")
    with pytest.raises(ValueError, match="top_k=4 exceeds the number of experts 3"):
        select_experts(_logits(2, 3, seed=0), cfg)
    with pytest.raises(ValueError, match=r"correction_bias must have shape \(8,\)"):
        select_experts(_logits(2, 8, seed=0), cfg, _bias(7, seed=0))
    with pytest.raises(ValueError, match="must be 2-D"):
        select_experts(_logits(2, 8, seed=0)[0], cfg)
    grouped = TopKConfig(top_k=4, scoring_func="sigmoid", num_expert_group=3, topk_group=2)
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by num_expert_group=3"):
        select_experts(_logits(2, 8, seed=0), grouped)
    narrow = TopKConfig(top_k=5, scoring_func="sigmoid", num_expert_group=4, topk_group=2)
    with pytest.raises(ValueError, match="top_k=5 exceeds the experts in the kept groups"):
        select_experts(_logits(2, 8, seed=0), narrow)


# --- hash routing --------------------------------------------------------------------------------


def _tid2eid(vocab: int, experts: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(experts, generator=g)[:k] for _ in range(vocab)]
    return torch.stack(rows).to(torch.int32)


def _ref_hash(
    input_ids: torch.Tensor, table: torch.Tensor, logits: torch.Tensor, cfg: TopKConfig
) -> tuple[np.ndarray, np.ndarray]:
    ids_out, w_out = [], []
    for token, row in zip(input_ids.tolist(), logits.double().tolist()):
        s = _ref_scores(row, cfg.scoring_func)
        ids = table[token].tolist()
        ids_out.append(ids)
        w_out.append(_ref_finish([s[e] for e in ids], cfg))
    return _ref_arrays(ids_out, w_out, cfg.top_k)


@pytest.mark.parametrize("scoring", SCORING)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("apply_scaling", [False, True])
def test_hash_matches_reference(scoring: str, renormalize: bool, apply_scaling: bool) -> None:
    cfg = TopKConfig(
        top_k=6,
        scoring_func=scoring,  # type: ignore[arg-type]
        renormalize=renormalize,
        routed_scaling_factor=1.5,
        apply_routed_scaling=apply_scaling,
    )
    table = _tid2eid(vocab=50, experts=32, k=6, seed=21)
    input_ids = torch.randint(0, 50, (33,), generator=torch.Generator().manual_seed(22))
    logits = _logits(33, 32, seed=23)
    out = hash_select_experts(input_ids, table, logits, cfg)
    _check(out, _ref_hash(input_ids, table, logits, cfg))


def test_hash_ignores_logits_for_selection_and_takes_bf16() -> None:
    cfg = TopKConfig(top_k=2, scoring_func="sqrtsoftplus")
    table = torch.tensor([[4, 1], [0, 3], [2, 5]], dtype=torch.int32)
    input_ids = torch.tensor([2, 0, 1, 2])
    logits = _logits(4, 6, seed=31).to(torch.bfloat16)
    out = hash_select_experts(input_ids, table, logits, cfg)
    assert out.topk_ids.tolist() == [[2, 5], [4, 1], [0, 3], [2, 5]]
    _check(out, _ref_hash(input_ids, table, logits.float(), cfg))
    routed = select_experts(logits, cfg)
    assert not torch.equal(routed.topk_ids, out.topk_ids)


def test_hash_empty_batch() -> None:
    cfg = TopKConfig(top_k=2, scoring_func="sqrtsoftplus")
    out = hash_select_experts(
        torch.empty(0, dtype=torch.long), _tid2eid(10, 8, 2, seed=1), torch.empty(0, 8), cfg
    )
    assert out.topk_ids.shape == (0, 2) and out.topk_ids.dtype == torch.int32
    assert out.topk_weights.shape == (0, 2) and out.topk_weights.dtype == torch.float32


@pytest.mark.parametrize("bad", [50, 77, -1])
def test_hash_bad_token_id_is_named(bad: int) -> None:
    cfg = TopKConfig(top_k=6, scoring_func="sqrtsoftplus")
    table = _tid2eid(vocab=50, experts=32, k=6, seed=21)
    input_ids = torch.tensor([3, bad, 7])
    with pytest.raises(ValueError, match=f"token id {bad} is out of range .* vocab size 50"):
        hash_select_experts(input_ids, table, _logits(3, 32, seed=1), cfg)


def test_hash_shape_errors() -> None:
    cfg = TopKConfig(top_k=6, scoring_func="sqrtsoftplus")
    table = _tid2eid(vocab=50, experts=32, k=6, seed=21)
    with pytest.raises(ValueError, match=r"tid2eid must have shape \[vocab_size, top_k=6\]"):
        hash_select_experts(torch.tensor([1, 2]), table[:, :4], _logits(2, 32, seed=1), cfg)
    with pytest.raises(ValueError, match=r"input_ids must have shape \(2,\)"):
        hash_select_experts(torch.tensor([1, 2, 3]), table, _logits(2, 32, seed=1), cfg)
    with pytest.raises(ValueError, match="maps a token to expert"):
        hash_select_experts(torch.tensor([1, 2]), table, _logits(2, 16, seed=1), cfg)


if __name__ == "__main__":
    run_this_file(__file__)
