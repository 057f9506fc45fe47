"""The grammar mask of one step: one int32 bitmask for the sampled rows (bit ``t`` of row ``i``:
token ``t`` is allowed for row ``i``; rows without a grammar are all ones), filled on the host by
the requests' matchers and applied to the logits on their device."""

from __future__ import annotations

import torch

from sglang.srt.utils.log import get_logger

logger = get_logger(__name__)
_fallback_logged = False


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class BitmaskBuffer:
    """A reusable host buffer (pinned when a GPU is present), so a step allocates nothing."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._buf: torch.Tensor | None = None

    def rows(self, n: int) -> torch.Tensor:
        """``n`` rows, all ones."""
        if self._buf is None or self._buf.shape[0] < n:
            size = max(n, 2 * (0 if self._buf is None else self._buf.shape[0]), 8)
            buf = torch.empty((size, bitmask_words(self.vocab_size)), dtype=torch.int32)
            self._buf = buf.pin_memory() if torch.cuda.is_available() else buf
        view = self._buf[:n]
        view.fill_(-1)
        return view


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    logits.masked_fill_(~allowed, float("-inf"))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place, on the logits' device (xgrammar's
    kernel; a torch implementation if that one cannot run here)."""
    global _fallback_logged
    mask = bitmask.to(logits.device, non_blocking=True)
    try:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1])
    except Exception as exc:  # noqa: BLE001 - an unavailable kernel must not fail the step
        if not _fallback_logged:
            logger.warning(f"xgrammar's bitmask kernel failed ({exc!r}); masking with torch")
            _fallback_logged = True
        apply_token_bitmask_torch(logits, mask)
