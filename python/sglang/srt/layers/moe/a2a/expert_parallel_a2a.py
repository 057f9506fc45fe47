"""``--moe-a2a-backend ep`` (chosen by ``--ep-size E > 1``): expert parallelism with all-to-all.
Each rank holds ``num_experts / E`` experts. With ``E == T`` (the TP size) they are whole; with
``E < T`` each expert's intermediate dim is also sliced over the ``T / E`` ranks that share it
(its MoE-TP group, :mod:`sglang.srt.distributed.moe_groups`).

The MoE input is the same on every rank of the TP group (attention TP replicates it; DP attention
gathers every group's tokens before the MoE). The rows are cut into ``E`` contiguous slices, one
per MoE-TP group; each rank moves its group's slice within its EP group (the ``E`` ranks that
hold the same intermediate slice of different experts):

1. dispatch: every routed (row, top-k slot) of the slice goes to the EP rank owning its expert,
   with its local expert id and top-k weight; the per-rank counts are exchanged first, then the
   rows and their routing (``all_to_all_single``: NCCL on GPU, gloo on CPU);
2. the runner computes the received rows on this rank's experts (its intermediate slice), one
   slot a row, weight applied (in place into the receive buffer, which is rank-local and never in
   the symmetric pool);
3. combine: the weighted outputs go back to the rows' ranks and are summed per row in fp32; with
   ``E < T`` those sums are partial (one intermediate slice) and are all-reduced over the MoE-TP
   group; then the slices are all-gathered over the EP group so every rank again holds every row
   (what the next layer reads).

No all-reduce over the whole TP group: traffic per layer is ~ ``rows * top_k * hidden`` each way
per EP group, one all-reduce of ``rows / E`` rows over each MoE-TP group (``E < T`` only) and one
all-gather of the rows. The shared expert is replicated and added after the combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sglang.srt.distributed.moe_groups import get_moe_groups
from sglang.srt.distributed.parallel_state import GroupCoordinator, get_tp_group_or_none
from sglang.srt.layers.moe.a2a.base import DispatchOutput, MoEA2ABackend
from sglang.srt.layers.moe.expert_weights import ExpertWeights
from sglang.srt.layers.moe.topk import TopKOutput


@dataclass(frozen=True)
class ExpertParallelHandle:
    """What the combine needs of one dispatch: this rank's row slice of the ``rows`` rows, the
    slice-local row of every slot sent (in send order) and the per-rank counts both ways."""

    rows: int
    lo: int
    hi: int
    sent_rows: torch.Tensor  # int64 [n_send]: the slice row of each sent slot
    send_counts: list[int]
    recv_counts: list[int]


def row_slice(rows: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous part of ``rows`` rows (the first ``rows % size`` ranks get one
    more), as ``torch.tensor_split`` cuts them."""
    base, extra = divmod(rows, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class ExpertParallelA2A(MoEA2ABackend):
    name = "ep"
    expert_parallel = True
    partial_ep_unsupported = None
    capture_unsafe_reason = (
        "the ep a2a backend reads the exchanged per-rank counts back to size its all-to-all"
    )

    def _groups(self) -> tuple[GroupCoordinator | None, GroupCoordinator | None]:
        """``(EP group, MoE-TP group)``; None for a group of one rank."""
        if self.tp_size == 1:
            return None, None
        tp = get_tp_group_or_none()
        if tp is None or tp.world_size != self.tp_size:
            raise RuntimeError(
                f"--moe-a2a-backend ep over {self.tp_size} ranks needs the TP group "
                f"initialized with {self.tp_size} ranks (got {tp})"
            )
        if self.ep_size == self.tp_size:
            return tp, None
        groups = get_moe_groups(self.ep_size)
        return (groups.ep if self.ep_size > 1 else None), groups.moe_tp

    def _exchange(
        self, group: GroupCoordinator | None, x: torch.Tensor, send: list[int], recv: list[int]
    ) -> torch.Tensor:
        """``x``'s rows cut by ``send`` to the group's ranks; the ``recv`` rows from each back."""
        if group is None:
            return x
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(
            out,
            x.contiguous(),
            output_split_sizes=recv,
            input_split_sizes=send,
            group=group.process_group_for(x),
        )
        return out

    def dispatch(
        self, hidden: torch.Tensor, topk: TopKOutput, weights: ExpertWeights
    ) -> DispatchOutput:
        ep, _ = self._groups()
        rows, k = topk.topk_ids.shape
        # One slice per MoE-TP group: its ranks move the same rows, each in its own EP group.
        lo, hi = row_slice(rows, self.ep_rank, self.ep_size)
        ids = topk.topk_ids[lo:hi].reshape(-1).long()
        per_rank = self.config.num_experts // self.ep_size
        valid = (ids >= 0) & (ids < self.config.num_experts)
        slots = valid.nonzero().squeeze(1)
        owner = ids[slots] // per_rank  # the owning EP rank (its rank in the EP group)
        order = torch.argsort(owner, stable=True)  # grouped by owning rank, slot order kept
        slots, owner = slots[order], owner[order]
        counts = torch.bincount(owner, minlength=self.ep_size)
        send_counts = counts.tolist()
        recv_counts = send_counts
        if ep is not None:
            # Sizes first: each rank learns how many slots every other rank sends it.
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=ep.process_group_for(counts))
            recv_counts = recv.tolist()
        sent_rows = slots // k
        # (local expert id, weight) of each slot, one fp32 pair: ids < 2^24 are exact.
        meta = torch.stack(
            [
                (ids[slots] - owner * per_rank).float(),
                topk.topk_weights[lo:hi].reshape(-1)[slots].float(),
            ],
            dim=1,
        )
        recv_rows = self._exchange(ep, hidden[lo:hi][sent_rows], send_counts, recv_counts)
        recv_meta = self._exchange(ep, meta, send_counts, recv_counts)
        local = TopKOutput(
            recv_meta[:, 1:].contiguous(),
            recv_meta[:, :1].to(topk.topk_ids.dtype).contiguous(),
        )
        handle = ExpertParallelHandle(rows, lo, hi, sent_rows, send_counts, recv_counts)
        return DispatchOutput(recv_rows, local, runner_inplace=True, handle=handle)

    def combine_routed(self, routed_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        h = dispatched.handle
        if not isinstance(h, ExpertParallelHandle):
            raise TypeError(f"ep combine got a dispatch of another backend: {h!r}")
        ep, moe_tp = self._groups()
        back = self._exchange(ep, routed_out, h.recv_counts, h.send_counts)
        # Weighted slot outputs summed per row in fp32, as the runners accumulate top-k.
        acc = torch.zeros(
            (h.hi - h.lo, routed_out.shape[1]), dtype=torch.float32, device=routed_out.device
        )
        acc.index_add_(0, h.sent_rows, back.float())
        if moe_tp is not None:
            # Each rank summed its intermediate slice of the experts: add the slices (in fp32,
            # like the sum above; rows / E rows, not the top-k slots).
            acc = moe_tp.all_reduce(acc)
        return self._gather_rows(ep, acc.to(routed_out.dtype), h.rows)

    def _gather_rows(
        self, group: GroupCoordinator | None, part: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """Every EP rank's row slice -> all ``rows`` rows on every rank (slices padded to the
        largest so the all-gather has one shape)."""
        if group is None:
            return part
        size = self.ep_size
        width = -(-rows // size)
        padded = part.new_zeros((width, part.shape[1]))
        padded[: part.shape[0]] = part
        stacked = group.all_gather(padded).view(size, width, part.shape[1])
        cuts = [row_slice(rows, r, size) for r in range(size)]
        return torch.cat([stacked[r, : hi - lo] for r, (lo, hi) in enumerate(cuts)])
