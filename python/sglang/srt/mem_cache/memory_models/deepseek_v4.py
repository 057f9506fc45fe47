"""DeepSeek V4's memory model. A request holds a fixed sliding-window ring per layer plus
compressed entries that grow by one row per ``ratio`` tokens (and the indexer's keys on ratio-4
layers), each row the bytes its cache stores (``--kv-cache-dtype``: ``head_dim`` values of the
model dtype, or a 584-byte FP8 row at head dim 512); the step workspace is the mHC residual
streams (``hidden * hc_mult`` wide) and the logits."""

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
    # Bytes of one stored compressed entry / indexer key (None: the model dtype's
    # ``head_dim * dtype_bytes`` / ``index_head_dim * dtype_bytes``); ``kv_cache``: the layout's
    # name for the startup log.
    entry_bytes: int | None = None
    index_key_bytes: int | None = None
    kv_cache: str = "bf16"

    @classmethod
    def from_model_config(
        cls,
        cfg: Any,
        dtype_bytes: int,
        *,
        entry_bytes: int | None = None,
        index_key_bytes: int | None = None,
        kv_cache: str = "bf16",
    ) -> CacheShape:
        """``entry_bytes`` / ``index_key_bytes``: a stored row of the ``--kv-cache-dtype``
        layout ``kv_cache`` (None: the model dtype's)."""
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
            entry_bytes=entry_bytes,
            index_key_bytes=index_key_bytes,
            kv_cache=kv_cache,
        )

    @property
    def entry_row_bytes(self) -> int:
        return self.entry_bytes or self.head_dim * self.dtype_bytes

    @property
    def index_key_row_bytes(self) -> int:
        return self.index_key_bytes or self.index_head_dim * self.dtype_bytes

    def layer_bytes_per_token(self, ratio: int, kind: str) -> float:
        """What one more cached token costs one layer of this ratio and kind (0 for sliding
        layers: their ring is fixed)."""
        if ratio <= 0:
            return 0.0
        per_row = self.entry_row_bytes + (self.index_key_row_bytes if kind == "csa" else 0)
        return per_row / ratio

    def bytes_per_cached_token(self) -> float:
        total = sum(
            self.layer_bytes_per_token(r, k) for r, k in zip(self.compress_ratios, self.attn_types)
        )
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
        kinds: dict[tuple[int, str], int] = {}
        for ratio, kind in zip(self.compress_ratios, self.attn_types):
            if ratio > 0:
                kinds[(ratio, kind)] = kinds.get((ratio, kind), 0) + 1
        per_kind = ", ".join(
            f"{n} x ratio {r}{' + indexer' if k == 'csa' else ''} "
            f"{self.layer_bytes_per_token(r, k):.2f} B"
            for (r, k), n in sorted(kinds.items())
        )
        return (
            f"DeepSeek V4: {self.bytes_per_cached_token():.1f} B per cached token ({self.kv_cache} "
            f"KV cache; per layer: {per_kind or 'none'}; entries {self.entry_row_bytes} B, "
            f"indexer keys {self.index_key_row_bytes} B a row), "
            f"{mib(self.window_bytes_per_request())} per running request "
            f"({self.num_layers} layers' {self.sliding_window}-row window rings)"
        )
