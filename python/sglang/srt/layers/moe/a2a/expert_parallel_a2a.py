"""``--moe-a2a-backend ep`` (chosen by ``--ep-size E > 1``): expert parallelism over the TP group
with all-to-all. Each rank holds ``num_experts / E`` whole experts (every intermediate row).

The MoE input is the same on every rank of the group (attention TP replicates it; DP attention
gathers every group's tokens before the MoE), so each rank takes its own contiguous slice of the
rows and moves only those:

1. dispatch: every routed (row, top-k slot) of the slice goes to the rank owning its expert, with
   its local expert id and top-k weight; the per-rank counts are exchanged first, then the rows
   and their routing (``all_to_all_single``: NCCL on GPU, gloo on CPU);
2. the runner computes the received rows on this rank's experts, one slot a row, weight applied
   (in place into the receive buffer, which is rank-local and never in the symmetric pool);
3. combine: the weighted outputs go back to the rows' ranks, are summed per row in fp32, and the
   slices are all-gathered so every rank again holds every row (what the next layer reads).

No all-reduce of the hidden: traffic per layer is ~ ``rows * top_k * hidden`` each way plus one
all-gather of the rows. The shared expert is replicated and added after the combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sglang.srt.distributed.parallel_state import GroupCoordinator, get_tp_group_or_none
from sglang.srt.layers.moe.a2a.base import DispatchOutput, MoEA2ABackend, RankExperts
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
    places_whole_experts = True
    capture_unsafe_reason = (
        "the ep a2a backend reads the exchanged per-rank counts back to size its all-to-all"
    )

    def _group(self) -> GroupCoordinator | None:
        if self.tp_size == 1:
            return None
        group = get_tp_group_or_none()
        if group is None or group.world_size != self.tp_size:
            raise RuntimeError(
                f"--moe-a2a-backend ep over {self.tp_size} ranks needs the TP group "
                f"initialized with {self.tp_size} ranks (got {group})"
            )
        return group

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
        self, hidden: torch.Tensor, topk: TopKOutput, experts: RankExperts
    ) -> DispatchOutput:
        group = self._group()
        rows, k = topk.topk_ids.shape
        lo, hi = row_slice(rows, self.tp_rank, self.tp_size)
        ids = topk.topk_ids[lo:hi].reshape(-1).long()
        per_rank = self.config.num_experts // self.tp_size
        valid = (ids >= 0) & (ids < self.config.num_experts)
        slots = valid.nonzero().squeeze(1)
        owner = ids[slots] // per_rank
        order = torch.argsort(owner, stable=True)  # grouped by owning rank, slot order kept
        slots, owner = slots[order], owner[order]
        counts = torch.bincount(owner, minlength=self.tp_size)
        send_counts = counts.tolist()
        recv_counts = send_counts
        if group is not None:
            # Sizes first: each rank learns how many slots every other rank sends it.
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=group.process_group_for(counts))
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
        recv_rows = self._exchange(group, hidden[lo:hi][sent_rows], send_counts, recv_counts)
        recv_meta = self._exchange(group, meta, send_counts, recv_counts)
        local = TopKOutput(
            recv_meta[:, 1:].contiguous(),
            recv_meta[:, :1].to(topk.topk_ids.dtype).contiguous(),
        )
        handle = ExpertParallelHandle(rows, lo, hi, sent_rows, send_counts, recv_counts)
        return DispatchOutput(recv_rows, local, runner_inplace=True, handle=handle)

    def combine(
        self,
        routed_out: torch.Tensor,
        dispatched: DispatchOutput,
        *,
        shared: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = dispatched.handle
        if not isinstance(h, ExpertParallelHandle):
            raise TypeError(f"ep combine got a dispatch of another backend: {h!r}")
        group = self._group()
        back = self._exchange(group, routed_out, h.recv_counts, h.send_counts)
        # Weighted slot outputs summed per row in fp32, as the runners accumulate top-k.
        acc = torch.zeros(
            (h.hi - h.lo, routed_out.shape[1]), dtype=torch.float32, device=routed_out.device
        )
        acc.index_add_(0, h.sent_rows, back.float())
        out = self._gather_rows(group, acc.to(routed_out.dtype), h.rows)
        return out if shared is None else out + shared

    def _gather_rows(
        self, group: GroupCoordinator | None, part: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """Every rank's row slice -> all ``rows`` rows on every rank (slices padded to the
        largest so the all-gather has one shape)."""
        if group is None:
            return part
        width = -(-rows // self.tp_size)
        padded = part.new_zeros((width, part.shape[1]))
        padded[: part.shape[0]] = part
        stacked = group.all_gather(padded).view(self.tp_size, width, part.shape[1])
        cuts = [row_slice(rows, r, self.tp_size) for r in range(self.tp_size)]
        return torch.cat([stacked[r, : hi - lo] for r, (lo, hi) in enumerate(cuts)])
