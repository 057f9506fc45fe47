"""Which experts, and which slice of them, a rank's MoE layers hold, and what an expert-parallel
rank must hold: for the EP parity tests. Light imports (every spawned rank imports it)."""

from __future__ import annotations

from typing import Any


def moe_held(model: Any) -> set[tuple[int, int, int, int]]:
    """(first expert, first intermediate row, experts, intermediate rows) of every MoE layer of
    this rank, checked against the w13 weights it loaded."""
    from sglang.srt.layers.moe.layer import FusedMoE

    held = set()
    for m in model.modules():
        if isinstance(m, FusedMoE):
            assert m.weights is not None
            rows = m.weights.w13.shape[0], m.weights.w13.shape[1] // 2
            assert rows == (len(m.local_experts), len(m.local_intermediate))
            held.add((m.local_experts.start, m.local_intermediate.start, *rows))
    return held


def expert_placement(
    rank: int, world: int, ep_size: int, experts: int, inter: int
) -> set[tuple[int, int, int, int]]:
    """What TP rank ``rank`` must hold: its EP rank's experts, its MoE-TP rank's slice of each."""
    moe_tp = world // ep_size
    e, i = experts // ep_size, inter // moe_tp
    return {((rank // moe_tp) * e, (rank % moe_tp) * i, e, i)}
