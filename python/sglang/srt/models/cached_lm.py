"""The request batching that DeepSeek V4 and Kimi K3 share as causal LMs over per-request caches.

A forward runs a batch of requests, each with its own cache, rows in request order; it extends
every cache in place, so a request's positions must continue its cache. ``prefill`` (one request,
any number of tokens) and ``decode`` (one token for each of many requests) are such batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar, cast

import torch
from torch import Tensor, nn

from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.moe.layer import FusedMoE
from sglang.srt.mem_cache.request_cache import RequestCache

CacheT = TypeVar("CacheT", bound=RequestCache[Any])
BatchT = TypeVar("BatchT", bound="RequestBatch[Any]")


@dataclass(frozen=True)
class RequestBatch(Generic[CacheT]):
    """The requests of one forward, in row order: ``seq_lens[i]`` new tokens for ``caches[i]``."""

    seq_lens: Sequence[int]
    caches: Sequence[CacheT]

    def __post_init__(self) -> None:
        if len(self.seq_lens) != len(self.caches):
            raise ValueError(f"{len(self.seq_lens)} sequence lengths for {len(self.caches)} caches")

    def starts(self) -> list[int]:
        """The first row of each request."""
        starts = [0]
        for n in self.seq_lens[:-1]:
            starts.append(starts[-1] + n)
        return starts[: len(self.seq_lens)]

    def advance(self) -> None:
        """Count the forward's new tokens into each request's cache (after every layer ran)."""
        for cache, n in zip(self.caches, self.seq_lens):
            cache.num_tokens += n


def check_batch(input_ids: Tensor, positions: Tensor, batch: RequestBatch[Any]) -> None:
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [T]"
        )
    if any(n < 0 for n in batch.seq_lens):
        raise ValueError(f"negative sequence length in {list(batch.seq_lens)}")
    if sum(batch.seq_lens) != input_ids.shape[0]:
        raise ValueError(
            f"sequence lengths {list(batch.seq_lens)} do not sum to {input_ids.shape[0]} rows"
        )
    if positions.is_cuda:
        return  # the check below reads positions back to the host
    start = 0
    for n, cache in zip(batch.seq_lens, batch.caches):
        want = torch.arange(len(cache), len(cache) + n, dtype=positions.dtype)
        if not torch.equal(positions[start : start + n].cpu(), want):
            raise ValueError(
                f"positions of a request must continue its cache ({len(cache)} tokens cached): "
                f"got {positions[start : start + n].tolist()[:8]}..."
            )
        start += n


def check_logit_rows(logit_rows: Tensor | None) -> None:
    """``logit_rows`` selects the rows a forward returns logits for: a 1-D int64 index."""
    if logit_rows is None:
        return
    if logit_rows.dim() != 1 or logit_rows.dtype != torch.long:
        raise ValueError(
            f"logit_rows must be a 1-D int64 index, got {logit_rows.dtype} "
            f"{tuple(logit_rows.shape)}"
        )


class CachedCausalLM(nn.Module, Generic[CacheT]):
    """Base of a model whose ``forward(input_ids, positions, batch=None, logit_rows=None)``
    returns logits ``[T, V]`` for a :class:`RequestBatch` (only ``logit_rows``' when given);
    subclasses set ``batch_type`` and implement ``new_request_cache``. ``spec`` is how this rank
    built the layers."""

    batch_type: ClassVar[type[RequestBatch[Any]]]

    def __init__(self, spec: LayerBuildSpec) -> None:
        super().__init__()
        self.spec = spec

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def device(self) -> torch.device:
        return self.spec.device

    @property
    def tp_rank(self) -> int:
        return self.spec.tp_rank

    @property
    def tp_size(self) -> int:
        return self.spec.tp_size

    def new_request_cache(self) -> CacheT:
        raise NotImplementedError

    def empty_logits(self, vocab_size: int) -> Tensor:
        """``[0, V]`` fp32 logits: a step that needs no row (no sampled row, an idle DP group)."""
        return torch.empty(0, vocab_size, dtype=torch.float32, device=self.device)

    def moe_layers(self) -> Iterator[FusedMoE]:
        """The routed-expert layers, in module order (how the executor reaches their runners)."""
        for module in self.modules():
            if isinstance(module, FusedMoE):
                yield module

    def _checked_batch(self, input_ids: Tensor, positions: Tensor, batch: BatchT | None) -> BatchT:
        """``batch`` once checked against the rows; without one, the rows are one whole request
        from position 0 (a throw-away cache)."""
        if batch is None:
            batch = cast(BatchT, self.batch_type([input_ids.shape[0]], [self.new_request_cache()]))
        check_batch(input_ids, positions, batch)
        return batch

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        batch: RequestBatch[CacheT] | None = None,
        logit_rows: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[T, V]`` (fp32) for ``input_ids [T]`` at ``positions [T]``; with
        ``logit_rows`` (int64 row indices) only those rows' ``[len(logit_rows), V]``.

        Without ``batch`` the rows are one whole request from position 0 (a throw-away cache).
        With ``batch`` each request's rows must continue its cache (positions ``len(cache) ..``);
        the caches are extended in place."""
        checked = self._checked_batch(input_ids, positions, batch)
        check_logit_rows(logit_rows)
        logits = self.forward_batch(input_ids, positions, checked, logit_rows)
        checked.advance()
        return logits

    def forward_batch(
        self,
        input_ids: Tensor,
        positions: Tensor,
        batch: RequestBatch[CacheT],
        logit_rows: Tensor | None,
    ) -> Tensor:
        """:meth:`forward` on a checked batch: write the rows into the caches (their token
        counts advance after) and return the logits."""
        raise NotImplementedError

    def prefill(self, input_ids: Tensor, cache: CacheT) -> Tensor:
        """Append ``input_ids [n]`` to one request; logits of those tokens ``[n, V]``."""
        start = len(cache)
        positions = torch.arange(start, start + input_ids.shape[0], device=input_ids.device)
        return self.forward(input_ids, positions, self.batch_type([input_ids.shape[0]], [cache]))

    def decode(self, input_ids: Tensor, caches: Sequence[CacheT]) -> Tensor:
        """One new token per request: ``input_ids [B]`` -> logits ``[B, V]``."""
        positions = torch.tensor(
            [len(cc) for cc in caches], dtype=torch.long, device=input_ids.device
        )
        return self.forward(input_ids, positions, self.batch_type([1] * len(caches), list(caches)))
