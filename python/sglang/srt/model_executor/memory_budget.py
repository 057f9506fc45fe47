"""The default ``--max-total-tokens``: how many cached tokens fit in GPU memory.

A DeepSeek V4 request holds a fixed sliding-window ring per layer plus compressed entries that
grow by ``head_dim / ratio`` per token (and the indexer's keys on ratio-4 layers). A step also
needs a workspace: the mHC residual streams and a layer's temporaries, which scale with the tokens
in flight (a prefill chunk plus the decodes), and the fp32 logits, which scale with the logit rows
only. The forward computes logits for the rows a step reads (``ForwardPlan.logit_rows``) and the
scheduler keeps those within ``--max-logit-rows-per-step``, so the logits take
``rows x vocab x 4`` bytes, twice (the logits and the sampler's fp32 copy), and not a whole
chunk's ``8192 x vocab``. So, with ``room`` = the ``--mem-fraction-static`` share of the GPU that
the weights left free::

    tokens = (room - activations(chunk + max_running) - logits(rows)
              - max_running * window_bytes) / bytes_per_cached_token

capped at ``context_length * max_running`` (more can never be used).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Temporaries of one layer's forward, in multiples of a [T, hidden * hc_mult] fp32 tensor.
_ACTIVATION_COPIES = 32
# fp32 [rows, vocab] tensors alive at once: the logits and the sampler's (log-)softmax copy.
_LOGIT_COPIES = 2


class MemoryBudgetError(RuntimeError):
    """The configuration cannot run in the memory there is; the message says what to change."""


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    hidden_size: int
    hc_mult: int
    vocab_size: int
    head_dim: int
    index_head_dim: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    attn_types: tuple[str, ...]
    dtype_bytes: int

    @classmethod
    def from_model_config(cls, cfg: Any, dtype_bytes: int) -> CacheShape:
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            hc_mult=getattr(cfg, "hc_mult", 1),
            vocab_size=cfg.vocab_size,
            head_dim=cfg.head_dim,
            index_head_dim=getattr(cfg, "index_head_dim", 0),
            sliding_window=getattr(cfg, "sliding_window", 0),
            compress_ratios=tuple(getattr(cfg, "compress_ratios", ())),
            attn_types=tuple(getattr(cfg, "attn_types", ())),
            dtype_bytes=dtype_bytes,
        )

    def bytes_per_cached_token(self) -> float:
        total = 0.0
        for ratio, kind in zip(self.compress_ratios, self.attn_types):
            if ratio > 0:
                total += self.head_dim * self.dtype_bytes / ratio
                if kind == "csa":
                    total += self.index_head_dim * self.dtype_bytes / ratio
        return max(total, 1.0)

    def window_bytes_per_request(self) -> int:
        return self.num_layers * self.sliding_window * self.head_dim * self.dtype_bytes

    def activation_bytes(self, tokens_in_flight: int) -> int:
        return tokens_in_flight * self.hidden_size * self.hc_mult * 4 * _ACTIVATION_COPIES

    def logits_bytes(self, logit_rows: int) -> int:
        return logit_rows * self.vocab_size * 4 * _LOGIT_COPIES

    def workspace_bytes(self, tokens_in_flight: int, logit_rows: int) -> int:
        return self.activation_bytes(tokens_in_flight) + self.logits_bytes(logit_rows)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _tokens_in_flight(chunked_prefill_size: int, max_running_requests: int) -> int:
    """A prefill chunk plus one decode row per running request: one step's rows at most."""
    return max(chunked_prefill_size, 1) + max_running_requests


def logits_reservation_note(
    shape: CacheShape, *, logit_rows: int, chunked_prefill_size: int, max_running_requests: int
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


def max_total_tokens_for_memory(
    shape: CacheShape,
    *,
    room_bytes: int,
    max_running_requests: int,
    chunked_prefill_size: int,
    context_length: int,
    max_logit_rows: int,
) -> int:
    """``max_logit_rows``: the logit rows one step computes at most on this rank (the scheduler's
    cap; under DP attention rank 0 receives every group's)."""
    if max_logit_rows < 1:
        raise ValueError(f"max_logit_rows must be >= 1, got {max_logit_rows}")
    in_flight = _tokens_in_flight(chunked_prefill_size, max_running_requests)
    fixed = (
        shape.workspace_bytes(in_flight, max_logit_rows)
        + max_running_requests * shape.window_bytes_per_request()
    )
    left = room_bytes - fixed
    if left <= 0:
        gib = 1 << 30
        raise MemoryBudgetError(
            f"the weights leave {room_bytes / gib:.2f} GiB of the --mem-fraction-static share, but "
            f"{max_running_requests} running requests, a {chunked_prefill_size}-token prefill "
            f"chunk and the logits of {max_logit_rows} rows need {fixed / gib:.2f} GiB before "
            "any cached token; lower --max-running-requests, --chunked-prefill-size or "
            "--max-logit-rows-per-step, or raise --mem-fraction-static"
        )
    tokens = int(left // shape.bytes_per_cached_token())
    return max(1, min(tokens, context_length * max_running_requests))
