"""DeepSeek V4's memory model. A request holds a fixed sliding-window ring per layer plus
compressed entries that grow by ``head_dim / ratio`` per token (and the indexer's keys on ratio-4
layers); the step workspace is the mHC residual streams (``hidden * hc_mult`` wide) and the
logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.mem_cache.memory_models.workspace import StepWorkspace, activation_bytes, mib


@dataclass(frozen=True)
class CacheShape(StepWorkspace):
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

    def snapshot_bytes(self) -> int:
        """Every layer's window ring, and on ratio-4 (overlapping) layers the fp32 previous-block
        rows ``[ratio, D]`` (kv and score) of the compressor and of the indexer's."""
        overlap = sum(
            2 * ratio * (self.head_dim + self.index_head_dim) * 4
            for ratio, kind in zip(self.compress_ratios, self.attn_types)
            if kind == "csa"
        )
        return self.window_bytes_per_request() + overlap

    def fixed_bytes(self, running_requests: int, context_length: int) -> int:
        """Every running request's window rings (their size does not depend on the context)."""
        return running_requests * self.window_bytes_per_request()

    def activation_bytes(self, tokens_in_flight: int) -> int:
        return activation_bytes(tokens_in_flight, self.hidden_size * self.hc_mult)

    def describe(self) -> str:
        compressed = sum(1 for r in self.compress_ratios if r > 0)
        return (
            f"DeepSeek V4: {self.bytes_per_cached_token():.1f} B per cached token "
            f"({compressed} compressed layers' entries and indexer keys), "
            f"{mib(self.window_bytes_per_request())} per running request "
            f"({self.num_layers} layers' {self.sliding_window}-row window rings)"
        )
