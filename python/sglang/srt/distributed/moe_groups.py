"""The two subgroups of the TP group that an expert-parallel MoE with ``--ep-size E < --tp-size T``
needs (``moe_tp_size = T / E``):

- the MoE-TP group: the ``T / E`` consecutive ranks that hold the same experts, each a slice of
  every expert's intermediate dim; their partial sums are all-reduced;
- the EP group: the ``E`` ranks, one per MoE-TP group, that hold the same intermediate slice of
  different experts; rows travel between them by all-to-all.

TP rank ``r`` is EP rank ``r // (T / E)`` and MoE-TP rank ``r % (T / E)``, so a MoE-TP group is
a run of neighbouring ranks (one node, when ``T / E`` ranks fit on one) and only the all-to-all
crosses nodes.

The groups are built on first use and kept for the TP group they were cut from: building a torch
group is collective over the world, and every rank builds its MoE layers, and runs their first
forward, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from sglang.srt.distributed.parallel_state import GroupCoordinator, get_tp_group


@dataclass(frozen=True)
class MoEGroups:
    ep: GroupCoordinator  # E ranks: same intermediate slice, different experts
    moe_tp: GroupCoordinator  # T / E ranks: same experts, different intermediate slices


def moe_group_ranks(world: int, tp_size: int, ep_size: int) -> tuple[list[list[int]], ...]:
    """``(ep groups, moe-tp groups)`` as global ranks, for every TP group of the world (each
    ``tp_size`` consecutive ranks)."""
    if ep_size < 1 or tp_size % ep_size or world % tp_size:
        raise ValueError(
            f"ep size {ep_size} must divide tp size {tp_size}, which must divide the world "
            f"size {world}"
        )
    m = tp_size // ep_size
    ep: list[list[int]] = []
    moe_tp: list[list[int]] = []
    for base in range(0, world, tp_size):
        moe_tp += [list(range(base + e * m, base + (e + 1) * m)) for e in range(ep_size)]
        ep += [[base + j + e * m for e in range(ep_size)] for j in range(m)]
    return ep, moe_tp


_cache: dict[int, MoEGroups] = {}
_cache_tp: GroupCoordinator | None = None


def get_moe_groups(ep_size: int) -> MoEGroups:
    """This rank's EP and MoE-TP groups for ``ep_size`` (collective on first call per size)."""
    global _cache_tp
    tp = get_tp_group()
    if _cache_tp is not tp:  # a new TP group (re-initialised): the old subgroups are gone
        _cache.clear()
        _cache_tp = tp
    groups = _cache.get(ep_size)
    if groups is None:
        ep_ranks, moe_tp_ranks = moe_group_ranks(dist.get_world_size(), tp.world_size, ep_size)
        groups = MoEGroups(
            ep=GroupCoordinator(ep_ranks, tp.local_rank, tp.backend, group_name="moe_ep"),
            moe_tp=GroupCoordinator(moe_tp_ranks, tp.local_rank, tp.backend, group_name="moe_tp"),
        )
        _cache[ep_size] = groups
    return groups
