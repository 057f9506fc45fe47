"""Attention Residuals ("AttnRes"): Kimi K3's replacement for the residual stream.

Per token, a forward pass keeps
- the **bank**: snapshots ``bank[0..nvb)`` of the stream, written every ``attn_res_block_size``
  layers (``bank[0]`` is the embedding, ``bank[j]`` the sum of block ``j - 1``'s sublayer outputs);
- the **partial sum** ``P`` of the sublayer outputs since the last bank write.
Each sublayer's input is a *read*: a softmax mix over the rows ``[bank..., P]``, weighted by how
each row scores against a learned vector, then that sublayer's own RMSNorm:
  score_r = <rmsnorm(r), res_norm.weight * res_proj.weight>     (plain RMSNorm, no weight)
  read    = out_norm(sum_r softmax(score)_r * r)                 (mix in fp32, cast, then norm)
With an empty bank the softmax has one row, so the read is ``out_norm(P)``.

The state is token-local (nothing crosses tokens), so it lives for one forward only and needs no
cache; rows of different requests in one batch never interact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sglang.kernels.ops.layernorm.attn_res_read import attn_res_read, attn_res_read_unfit_reason
from sglang.kernels.ops.triton_dispatch import triton_can_run
from sglang.srt.environ import envs
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.utils.log import get_logger, log_path_once

logger = get_logger(__name__)


def attn_res_score_vector(res_norm: RMSNorm, res_proj: ReplicatedLinear) -> Tensor:
    """One read site's ``<site>_res_norm.weight [H]`` times ``<site>_res_proj.weight [1, H]``, fp32:
    the norm's weight and the projection fold into one vector (computed once per forward)."""
    return res_norm.weight.float() * res_proj.weight[0].float()


class AttnResState:
    """The bank and partial sum of one forward, ``[T, H]`` rows in the activation dtype."""

    def __init__(self, embeddings: Tensor | None) -> None:
        self.bank: list[Tensor] = []
        self.partial: Tensor | None = embeddings

    def read(self, score_vector: Tensor, eps: float, out_norm: RMSNorm) -> Tensor:
        """The input of the next sublayer: the mix of ``[bank..., P]``, through ``out_norm``."""
        if self.partial is None:
            raise RuntimeError(
                "AttnRes read with an empty partial sum (a read must follow a sublayer)"
            )
        if not self.bank:
            return out_norm(self.partial)
        why = (
            None
            if envs.SGLANG_K3_ATTN_RES_KERNEL.get() and triton_can_run(self.partial)
            else "SGLANG_K3_ATTN_RES_KERNEL=0 or no Triton device"
        )
        rows = None
        if why is None:
            rows = torch.stack([*self.bank, self.partial], dim=1)
            why = attn_res_read_unfit_reason(rows)
        log_path_once(logger, "Kimi K3 AttnRes read", why)
        if why is None and rows is not None:
            # one launch instead of ~15 (same maths, fp32)
            out = torch.empty_like(self.partial)
            return attn_res_read(rows, score_vector, out_norm.weight, eps, out_norm.eps, out)
        return self.read_reference(score_vector, eps, out_norm)

    def read_reference(self, score_vector: Tensor, eps: float, out_norm: RMSNorm) -> Tensor:
        """:meth:`read` in torch ops (CPU path and the kernel's reference)."""
        assert self.partial is not None
        if not self.bank:
            return out_norm(self.partial)
        rows = torch.stack([*self.bank, self.partial], dim=1).float()  # [T, R, H]
        normed = rows * torch.rsqrt(rows.square().mean(-1, keepdim=True) + eps)
        alpha = torch.softmax(normed @ score_vector, dim=-1)  # [T, R]
        mix = torch.einsum("tr,trh->th", alpha, rows)
        return out_norm(mix.to(self.partial.dtype))

    def select_rows(self, rows: Tensor) -> AttnResState:
        """The state of ``rows`` (an int64 index) only: reads are per token, so the last read
        needs no other rows."""
        picked = AttnResState(None if self.partial is None else self.partial.index_select(0, rows))
        picked.bank = [b.index_select(0, rows) for b in self.bank]
        return picked

    def write_bank(self) -> None:
        """Snapshot ``P`` into the bank and start a new block."""
        if self.partial is None:
            raise RuntimeError("AttnRes bank write with an empty partial sum")
        self.bank.append(self.partial)
        self.partial = None

    def add(self, sublayer_out: Tensor) -> None:
        self.partial = sublayer_out if self.partial is None else self.partial + sublayer_out
