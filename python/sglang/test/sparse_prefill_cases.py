"""Random inputs for DeepSeek V4's sparse prefill attention and the two ways to compute it: the
torch path (``dsv4_attention``, a dense visibility mask) and the Triton kernel (the indexer's picks
as ids). Shared by the CPU (interpreter) and GPU kernel tests and the kernel benchmark."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.kernels.ops.attention.sparse_prefill_attention import sparse_prefill_attention
from sglang.srt.layers.attention.dsv4_core import dsv4_attention


@dataclass(frozen=True)
class PrefillCase:
    n: int  # new queries
    heads: int
    dim: int
    window: int
    ratio: int  # 0: window only
    q_first: int  # position of the first new query (> 0: a later prefill chunk)
    topk: int = 0  # > 0: indexed (ratio-4 style picks), else every complete block is visible
    fp32_q: bool = False  # an fp32 query (split into three bf16 parts by the kernel)
    extra_rows: int = 0  # window rows older than any query needs (the kernel must skip them)


@dataclass(frozen=True)
class PrefillInputs:
    case: PrefillCase
    q: torch.Tensor
    pos: torch.Tensor
    win_kv: torch.Tensor
    win_first: int
    entries: torch.Tensor | None
    mask: torch.Tensor | None  # the torch path's [n, N] visibility
    picks: torch.Tensor | None  # the kernel's [n, k] ids (indexed layers)
    sink: torch.Tensor

    @property
    def scale(self) -> float:
        return self.case.dim**-0.5


def make_inputs(case: PrefillCase, device: str, gen: torch.Generator) -> PrefillInputs:
    """Random bf16 keys and (bf16 or fp32) queries; the picks as the indexer makes them (random
    scores, invisible entries at ``-inf``, a stable descending sort, ``k = min(topk, N)``)."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    c = case
    ring = min(c.q_first, c.window - 1 + c.extra_rows)
    win_first = c.q_first - ring
    win_kv = randn(ring + c.n, c.dim).to(torch.bfloat16)
    q = randn(c.n, c.heads, c.dim) * 2.0
    q = q if c.fp32_q else q.to(torch.bfloat16)
    sink = randn(c.heads)
    pos = torch.arange(c.q_first, c.q_first + c.n, device=device)
    entries = mask = picks = None
    if c.ratio:
        total = (c.q_first + c.n) // c.ratio
        entries = randn(total, c.dim).to(torch.bfloat16)
        ids = torch.arange(total, device=device)
        ok = ids[None, :] < ((pos + 1) // c.ratio)[:, None]
        mask = ok
        if c.topk:
            scores = randn(c.n, total).masked_fill(~ok, float("-inf"))
            k = min(c.topk, total)
            picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
            picked = torch.zeros_like(ok)
            picked.scatter_(1, picks, True)
            mask = picked & ok
    return PrefillInputs(c, q, pos, win_kv, win_first, entries, mask, picks, sink)


def torch_path(x: PrefillInputs) -> torch.Tensor:
    c = x.case
    return dsv4_attention(
        x.q,
        x.pos,
        c.q_first,
        x.win_kv,
        x.win_first,
        x.entries,
        x.mask,
        x.sink,
        scale=x.scale,
        window=c.window,
    )


def kernel_path(x: PrefillInputs, **tuning: int) -> torch.Tensor:
    c = x.case
    return sparse_prefill_attention(
        x.q,
        c.q_first,
        x.win_kv,
        x.win_first,
        x.sink,
        scale=x.scale,
        window=c.window,
        entries=x.entries,
        ratio=c.ratio,
        picks=x.picks,
        **tuning,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def max_row_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst query's relative error (every head of it)."""
    return float(((out - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))).max())
