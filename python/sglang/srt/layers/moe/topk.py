"""MoE routing: router logits -> (top-k weights, top-k expert ids) for every token.

Covers the routers of the models we serve:

* DeepSeek V4: ``sqrtsoftplus`` scores, ``noaux_tc`` selection (``s + correction_bias``), ungrouped,
  renormalised, ``routed_scaling_factor`` 1.5; its first ``num_hash_layers`` layers pick experts by
  a token-id table instead (:func:`hash_select_experts`).
* Kimi K3: ``sigmoid`` scores, ``noaux_tc`` selection, one group (a no-op), renormalised.
* Plain softmax routers, and DeepSeek-V3-style group-limited selection.

The bias only steers *selection*; the returned weights always come from the unbiased scores.
Pure torch, so the same code runs on CPU and GPU and serves as the reference for fused kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

ScoringFunc = Literal["softmax", "sigmoid", "sqrtsoftplus"]
SCORING_FUNCS: tuple[str, ...] = get_args(ScoringFunc)

# Added to the renormalisation denominator so that all-zero weights (e.g. underflowed sigmoids)
# give zeros instead of NaN; matches the reference routers.
_RENORM_EPS = 1e-20
# DeepSeek's group score is the sum of the best two (biased) scores in the group.
_GROUP_SCORE_TOP = 2


@dataclass(frozen=True)
class TopKConfig:
    """How a MoE layer routes tokens to experts.

    ``apply_routed_scaling``: when True, ``routed_scaling_factor`` is multiplied into the returned
    weights; when False the caller (expert runner or the combine) applies it later.
    ``num_expert_group`` / ``topk_group``: DeepSeek-style group-limited selection; both or neither.
    """

    top_k: int
    scoring_func: ScoringFunc
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    apply_routed_scaling: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"TopKConfig.top_k must be a positive int, got {self.top_k!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"TopKConfig.scoring_func={self.scoring_func!r} is not supported; "
                f"expected one of {SCORING_FUNCS}"
            )
        factor = self.routed_scaling_factor
        if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
            raise ValueError(
                f"TopKConfig.routed_scaling_factor must be a finite number > 0, got {factor!r}"
            )
        groups, kept = self.num_expert_group, self.topk_group
        if (groups is None) != (kept is None):
            raise ValueError(
                "TopKConfig.num_expert_group and topk_group must be set together, got "
                f"num_expert_group={groups!r}, topk_group={kept!r}"
            )
        if groups is not None and kept is not None:
            if groups < 1:
                raise ValueError(f"TopKConfig.num_expert_group must be >= 1, got {groups}")
            if not 1 <= kept <= groups:
                raise ValueError(
                    f"TopKConfig.topk_group must be in [1, num_expert_group={groups}], got {kept}"
                )

    @property
    def grouped(self) -> bool:
        return self.num_expert_group is not None


class TopKOutput(NamedTuple):
    topk_weights: Tensor  # fp32 [T, k]
    topk_ids: Tensor  # int32 [T, k]


def compute_scores(logits: Tensor, scoring_func: ScoringFunc) -> Tensor:
    """Per-expert scores from fp32 logits [T, E]; softmax is over the experts of one token."""
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    raise ValueError(f"unknown scoring_func {scoring_func!r}; expected one of {SCORING_FUNCS}")


def select_experts(
    router_logits: Tensor, config: TopKConfig, correction_bias: Tensor | None = None
) -> TopKOutput:
    """Route each token of ``router_logits`` [T, E] to ``config.top_k`` experts.

    Selection ranks ``s + correction_bias`` (or ``s`` without a bias); weights are the unbiased
    ``s`` at the chosen ids. Ids come out in descending order of the selection score; ties are
    broken by ``torch.topk``, so results are deterministic."""
    logits = _as_fp32_logits(router_logits)
    num_experts = logits.shape[1]
    if config.top_k > num_experts:
        raise ValueError(f"top_k={config.top_k} exceeds the number of experts {num_experts}")
    scores = compute_scores(logits, config.scoring_func)
    choice = scores
    if correction_bias is not None:
        if correction_bias.shape != (num_experts,):
            raise ValueError(
                f"correction_bias must have shape ({num_experts},), got "
                f"{tuple(correction_bias.shape)}"
            )
        choice = scores + correction_bias.to(device=scores.device, dtype=torch.float32)
    if config.grouped:
        choice = _mask_to_best_groups(choice, config)
    topk_ids = torch.topk(choice, config.top_k, dim=-1, sorted=True).indices
    topk_weights = scores.gather(1, topk_ids)
    return TopKOutput(_finish_weights(topk_weights, config), topk_ids.to(torch.int32))


def hash_select_experts(
    input_ids: Tensor, tid2eid: Tensor, router_logits: Tensor, config: TopKConfig
) -> TopKOutput:
    """DeepSeek V4's hash-routed layers: experts come from a fixed token-id table.

    ``ids = tid2eid[input_ids]`` with ``tid2eid`` [vocab, top_k]; weights are the router scores at
    those ids, renormalised and scaled as configured. Group settings do not apply (the table
    chooses the experts) and are ignored."""
    logits = _as_fp32_logits(router_logits)
    num_tokens, num_experts = logits.shape
    if input_ids.dim() != 1 or input_ids.shape[0] != num_tokens:
        raise ValueError(
            f"input_ids must have shape ({num_tokens},) to match router_logits, got "
            f"{tuple(input_ids.shape)}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    if tid2eid.dim() != 2 or tid2eid.shape[1] != config.top_k:
        raise ValueError(
            f"tid2eid must have shape [vocab_size, top_k={config.top_k}], got "
            f"{tuple(tid2eid.shape)}"
        )
    vocab_size = tid2eid.shape[0]
    ids = input_ids.to(device=tid2eid.device, dtype=torch.long)
    check = _may_sync(ids)
    if check:
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.numel() > 0:
            raise ValueError(
                f"token id {int(bad[0])} is out of range for tid2eid with vocab size {vocab_size}"
            )
    topk_ids = tid2eid[ids].to(device=logits.device, dtype=torch.long)
    if check:
        bad = topk_ids[(topk_ids < 0) | (topk_ids >= num_experts)]
        if bad.numel() > 0:
            raise ValueError(
                f"tid2eid maps a token to expert {int(bad[0])}, outside [0, {num_experts})"
            )
    scores = compute_scores(logits, config.scoring_func)
    topk_weights = scores.gather(1, topk_ids)
    return TopKOutput(_finish_weights(topk_weights, config), topk_ids.to(torch.int32))


# --- helpers ----------------------------------------------------------------------------------


def _as_fp32_logits(router_logits: Tensor) -> Tensor:
    if router_logits.dim() != 2:
        raise ValueError(
            f"router_logits must be 2-D [num_tokens, num_experts], got shape "
            f"{tuple(router_logits.shape)}"
        )
    if not router_logits.dtype.is_floating_point:
        raise ValueError(f"router_logits must be floating point, got {router_logits.dtype}")
    return router_logits.float()


def _mask_to_best_groups(choice: Tensor, config: TopKConfig) -> Tensor:
    """Keep the selection scores of the ``topk_group`` best groups; the rest become -inf."""
    assert config.num_expert_group is not None and config.topk_group is not None
    num_tokens, num_experts = choice.shape
    groups = config.num_expert_group
    if num_experts % groups != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by num_expert_group={groups}")
    group_size = num_experts // groups
    if config.top_k > config.topk_group * group_size:
        raise ValueError(
            f"top_k={config.top_k} exceeds the experts in the kept groups "
            f"(topk_group={config.topk_group} x {group_size} experts a group)"
        )
    per_group = choice.view(num_tokens, groups, group_size)
    # With one expert a group there is no second score to add.
    best = torch.topk(per_group, min(_GROUP_SCORE_TOP, group_size), dim=-1).values
    kept = torch.topk(best.sum(dim=-1), config.topk_group, dim=-1).indices
    keep = torch.zeros(num_tokens, groups, dtype=torch.bool, device=choice.device)
    keep.scatter_(1, kept, True)
    keep = keep.unsqueeze(-1).expand(-1, -1, group_size).reshape(num_tokens, num_experts)
    return choice.masked_fill(~keep, float("-inf"))


def _finish_weights(weights: Tensor, config: TopKConfig) -> Tensor:
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _RENORM_EPS)
    if config.apply_routed_scaling:
        weights = weights * config.routed_scaling_factor
    return weights.to(torch.float32).contiguous()


def _may_sync(t: Tensor) -> bool:
    """Value checks read back to the host, which is illegal during CUDA-graph capture; they are
    skipped there (the eager warm-up before capture still runs them)."""
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())
