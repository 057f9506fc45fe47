"""The default ``--max-total-tokens``: how many cached tokens fit in GPU memory.

Each architecture describes its memory in a *memory model* (``mem_cache/memory_models/``,
offered by the model's ``memory_model()``, :class:`SupportsMemoryModel`): the bytes one cached
token takes, the fixed bytes of the running requests, and a step's workspace. DeepSeek V4's
(:class:`CacheShape`): a request holds a fixed sliding-window ring per layer plus compressed
entries that grow by ``head_dim / ratio`` per token (and the indexer's keys on ratio-4 layers).
Kimi K3's (``KimiK3MemoryModel``): a request holds every KDA layer's recurrent and conv state
(fixed size) and every MLA layer's latent row per token; its pool adds a scratch slot and a null
block. The workspace is a layer's temporaries, which scale with the tokens in flight (a prefill
chunk plus the decodes; the mHC streams for DeepSeek V4, the AttnRes bank for Kimi K3), and the
fp32 logits, which scale with the logit rows only. The forward computes logits for the rows a
step reads (``ForwardPlan.logit_rows``) and the scheduler keeps those within
``--max-logit-rows-per-step``, so the logits take ``rows x vocab x 4`` bytes, twice (the logits
and the sampler's fp32 copy), and not a whole chunk's ``8192 x vocab``. So, with ``room`` = the
``--mem-fraction-static`` share of the GPU that the weights left free::

    tokens = (room - activations(chunk + max_running) - logits(rows)
              - fixed(max_running, context)) / bytes_per_cached_token

capped at ``context_length * max_running`` (more can never be used). The prefix cache's state
snapshots (``--max-state-snapshots``, each a request's fixed-size state) are fixed bytes too.
Without a memory model, or without a GPU to measure, the default is that cap: the worst case, not a
bound (:func:`unbounded_budget_reason`), which the executor then refuses to preallocate.
"""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.memory_models.deepseek_v4 import CacheShape
from sglang.srt.mem_cache.memory_models.memory_model import MemoryModel
from sglang.srt.mem_cache.memory_models.weight_bytes import WeightBytes, human_bytes
from sglang.srt.mem_cache.memory_models.workspace import gib as _gib
from sglang.srt.model_executor.model_abilities import SupportsMemoryModel

__all__ = [
    "CacheShape",
    "MemoryBudgetError",
    "MemoryModel",
    "logits_reservation_note",
    "max_total_tokens_for_memory",
    "memory_model_of",
    "unbounded_budget_reason",
    "weights_note",
]


class MemoryBudgetError(RuntimeError):
    """The configuration cannot run in the memory there is; the message says what to change."""


def memory_model_of(model: object) -> MemoryModel | None:
    """The model's own memory model (None: it offers none)."""
    return model.memory_model() if isinstance(model, SupportsMemoryModel) else None


def unbounded_budget_reason(model: object, device: torch.device) -> str | None:
    """Why the default ``--max-total-tokens`` on ``device`` is the worst case (context x max
    running requests) rather than a bound measured from GPU memory (None: it is measured)."""
    if not isinstance(model, SupportsMemoryModel):
        return f"{type(model).__name__} has no memory model"
    if device.type != "cuda":
        return f"on {device.type} there is no GPU memory to measure"
    return None


def _tokens_in_flight(chunked_prefill_size: int, max_running_requests: int) -> int:
    """A prefill chunk plus one decode row per running request: one step's rows at most."""
    return max(chunked_prefill_size, 1) + max_running_requests


def logits_reservation_note(
    shape: MemoryModel, *, logit_rows: int, chunked_prefill_size: int, max_running_requests: int
) -> str:
    """The startup log's line on what the budget reserved for logits, and why that many rows."""
    whole = _tokens_in_flight(chunked_prefill_size, max_running_requests)
    return (
        f"memory budget: {_gib(shape.logits_bytes(logit_rows))} reserved for the fp32 logits of "
        f"{logit_rows} rows (--max-logit-rows-per-step: a step computes logits only for the rows "
        f"it samples or returns prompt log-probs for, at most that many), not "
        f"{_gib(shape.logits_bytes(whole))} for every row of a {chunked_prefill_size}-token "
        f"chunk plus {max_running_requests} decodes; activations "
        f"{_gib(shape.activation_bytes(whole))}"
    )


def weights_note(resident: WeightBytes, in_use_bytes: int) -> str:
    """The startup line on what the weights hold of the GPU memory in use before the caches:
    their resident bytes per format (MXFP4 experts at ~0.53 B a parameter, FP8 at ~1 B, bf16 at
    2 B), counted from the tensors themselves, and what else is in use (CUDA context, workspace
    pools)."""
    formats = ", ".join(f"{fmt} {human_bytes(n)}" for fmt, n in resident.by_format().items())
    other = in_use_bytes - resident.total()
    return (
        f"memory budget: weights resident {human_bytes(resident.total())} ({formats}); "
        f"{human_bytes(max(other, 0))} more in use on the GPU before the caches"
    )


def max_total_tokens_for_memory(
    shape: MemoryModel,
    *,
    room_bytes: int,
    max_running_requests: int,
    chunked_prefill_size: int,
    context_length: int,
    max_logit_rows: int,
    state_snapshots: int = 0,
) -> int:
    """``max_logit_rows``: the logit rows one step computes at most on this rank (the scheduler's
    cap; under DP attention rank 0 receives every group's); ``state_snapshots``: the prefix
    cache's snapshot rows (0: no prefix cache)."""
    if max_logit_rows < 1:
        raise ValueError(f"max_logit_rows must be >= 1, got {max_logit_rows}")
    in_flight = _tokens_in_flight(chunked_prefill_size, max_running_requests)
    fixed = shape.workspace_bytes(in_flight, max_logit_rows) + shape.fixed_bytes(
        max_running_requests, context_length
    )
    fixed += state_snapshots * shape.snapshot_bytes()
    left = room_bytes - fixed
    if left <= 0:
        gib = 1 << 30
        raise MemoryBudgetError(
            f"the weights leave {room_bytes / gib:.2f} GiB of the --mem-fraction-static share, but "
            f"{max_running_requests} running requests, a {chunked_prefill_size}-token prefill "
            f"chunk, the logits of {max_logit_rows} rows and {state_snapshots} prefix-cache "
            f"state snapshots need {fixed / gib:.2f} GiB before any cached token; lower "
            "--max-running-requests, --chunked-prefill-size, --max-logit-rows-per-step or "
            "--max-state-snapshots, or raise --mem-fraction-static"
        )
    tokens = int(left // shape.bytes_per_cached_token())
    return max(1, min(tokens, context_length * max_running_requests))
