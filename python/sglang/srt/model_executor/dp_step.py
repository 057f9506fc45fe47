"""One DP-attention step on one rank: set the step's DP state, run this group's sub-plan (or an
empty forward when the group is idle but others are not, so the MoE's collectives line up), and
bring every group's logit rows to rank 0, which samples for all of them.

Each group's forward returns only the rows its sub-plan's ``logit_rows`` name (the sampled rows,
plus prompt rows whose log-probs were asked for), and those travel over the TP group's gloo group:
exact and simple; a GPU deployment would rather gather them over the device group.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang.srt.distributed.parallel_state import (
    get_attention_dp_rank,
    get_attn_tp_group,
    get_tp_group,
)
from sglang.srt.layers.dp_attention import DpPaddingMode, set_dp_state_for_step
from sglang.srt.model_executor.forward_plan import ForwardPlan


def run_idle_forward(model: Any) -> torch.Tensor:
    """A model that serves DP attention implements ``forward_idle()``: the forward of zero local
    tokens, which still joins the gather and scatter around its MoE blocks."""
    idle = getattr(model, "forward_idle", None)
    if idle is None:
        raise RuntimeError(
            f"{type(model).__name__} has no forward_idle(): it cannot run an idle DP group's step"
        )
    return idle()


def gather_dp_logits(logits: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Every group's logit rows concatenated in group order on TP rank 0 (None on the other
    ranks): the plan's ``output_rows``. Each group's first rank sends them (the ranks of a group
    hold the same logits)."""
    tp, attn = get_tp_group(), get_attn_tp_group()
    mine = logits.cpu() if logits is not None and attn.rank_in_group == 0 else None
    parts = tp.gather_object(mine, dst=0)
    if parts is None:
        return None
    kept = [p for p in parts if p is not None]  # [0, V] too: a step may need no rows at all
    if not kept:
        return None
    return torch.cat(kept).to(device)


def execute_dp_plan(runner: Any, plan: ForwardPlan) -> torch.Tensor | None:
    """``runner`` is a :class:`ModelRunner`; ``plan`` carries ``dp_plans``."""
    dp_rank = get_attention_dp_rank()
    if len(plan.dp_plans) != get_tp_group().world_size // get_attn_tp_group().world_size:
        raise ValueError(f"the plan has {len(plan.dp_plans)} DP groups, this engine another count")
    set_dp_state_for_step(plan.dp_num_tokens, DpPaddingMode(plan.dp_padding), dp_rank)
    own = plan.for_dp_rank(dp_rank)
    logits = runner.execute(own)  # frees, new caches, and this group's rows
    if not plan.has_forward:
        return None
    if not own.has_forward:
        logits = run_idle_forward(runner.model)
    return gather_dp_logits(logits, runner.device)
