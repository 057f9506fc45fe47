"""How far a bf16 decode drifts from its reference, step by step: the graph tests' bound.

A step may jump where some MoE router's top-k flips at a near-tie (measured on the H200 with
``scripts/dsv4_kernel_path_diff.py --routing``: kernels equal to the torch path to 3e-7 per layer,
one flip at a router gap of 3.6e-4 made one step 0.35 and the next 0.015). A flipped token then
stays in the window ring (and in the compressed entries) with other values, so every later step
drifts more (``dsv4_kernel_path_diff.py --matrix`` on CPU: 0.01 before a flip at gap 7.2e-4,
0.03-0.06 for the 30 steps after; median 0.0289 against 0.0109 when followed).
:class:`RouteFollower` takes that discontinuity out: the reference follows the choice the checked
path made wherever the two differ only at a near-tie, and fails where they differ by more.
What is left is the continuous difference: most steps must stay within the bound and the median
far below it."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Self

import torch

from sglang.srt.layers.moe.topk import (
    TopKConfig,
    TopKOutput,
    compute_scores,
    hash_select_experts,
)

# A router near-tie: the followed expert's selection score is this close below the router's own
# last pick. The two paths' hidden states differ by ~1% (bf16 summation order), which moves the
# O(1) scores by up to ~1e-2: measured on the H200, followed gaps 7.8e-4 to 5.8e-3.
NEAR_TIE = 2e-2


def mean_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean absolute difference over the mean magnitude of ``ref``."""
    return float((out.float() - ref.float()).abs().mean() / ref.float().abs().mean())


def check_drift(errs: list[float], what: str, bound: float = 0.05) -> None:
    """Median step error < 0.02 and at most a tenth of the steps at or past ``bound``."""
    median = sorted(errs)[len(errs) // 2]
    over = sum(e >= bound for e in errs)
    assert median < 0.02 and over <= len(errs) // 10, (what, median, over, errs)


class RouteFollower:
    """Wraps ``module.select_experts``: in ``record`` mode it keeps each call's expert ids (the
    checked path's step); in ``follow`` mode the n-th call takes the n-th recorded choice for
    its rows (the first rows of the recorded call: the checked path may carry padding rows)
    wherever its own choice differs from it only at a near-tie (:data:`NEAR_TIE`), and raises
    where it differs by more. Use as a context manager; ``gaps`` lists each followed flip's gap."""

    def __init__(self, module: ModuleType, near_tie: float = NEAR_TIE) -> None:
        self.module, self.near_tie = module, near_tie
        self.real: Callable[..., TopKOutput] = module.select_experts
        self.mode = "off"
        self.recorded: list[torch.Tensor] = []
        self.calls = 0
        self.gaps: list[float] = []

    def __enter__(self) -> Self:
        self.module.select_experts = self._select  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: object) -> None:
        self.module.select_experts = self.real  # type: ignore[attr-defined]

    def record(self) -> None:
        self.mode, self.recorded = "record", []

    def follow(self) -> None:
        self.mode, self.calls = "follow", 0

    def off(self) -> None:
        self.mode = "off"

    def _select(
        self, logits: torch.Tensor, config: TopKConfig, bias: torch.Tensor | None = None
    ) -> TopKOutput:
        out = self.real(logits, config, bias)
        if self.mode == "record":
            self.recorded.append(out.topk_ids.clone())
            return out
        if self.mode != "follow":
            return out
        if self.calls >= len(self.recorded):
            raise AssertionError(f"router call {self.calls} has no recorded choice")
        want = self.recorded[self.calls][: logits.shape[0]].to(out.topk_ids.device)
        self.calls += 1
        own, wanted = out.topk_ids.sort(-1).values, want.sort(-1).values
        if torch.equal(own, wanted):
            return out
        choice = compute_scores(logits.float(), config.scoring_func)
        if bias is not None:
            choice = choice + bias.float()
        for row in torch.nonzero((own != wanted).any(-1)).flatten().tolist():
            last = choice[row, out.topk_ids[row].long()].min()
            missing = [e for e in want[row].tolist() if e not in out.topk_ids[row].tolist()]
            gap = float(last - choice[row, missing].min())
            if gap > self.near_tie:
                raise AssertionError(
                    f"router call {self.calls - 1}, row {row}: {want[row].tolist()} recorded, "
                    f"{out.topk_ids[row].tolist()} chosen, gap {gap:.2e} > {self.near_tie:g}"
                )
            self.gaps.append(gap)
        # The recorded ids with the weights select_experts gives them (the router's scores at
        # those ids, renormalised and scaled): a per-row table, as hash routing uses.
        rows = torch.arange(logits.shape[0], device=logits.device)
        return hash_select_experts(rows, want.long(), logits, config)
