"""The online-softmax steps the flash-style attention kernels share (DeepSeek V4's sparse decode
and sparse prefill, Kimi K3's absorbed MLA decode): one key tile into the running max, sum and
probabilities, and, for the split-K kernels, each key slice's weight in the combine; and the row
widths their dots take (``kernel_head_dim_ok``).

A slice that saw no live key keeps the running max :data:`EMPTY` (finite, so ``EMPTY - EMPTY``
is no ``inf - inf``); the combine gives it weight 0."""

from __future__ import annotations

import triton
import triton.language as tl

EMPTY = tl.constexpr(-1.0e30)


def kernel_head_dim_ok(d: int) -> bool:
    """Row widths the kernels take (a head's, a latent's): powers of two from 16 (the dot's
    smallest K)."""
    return d >= 16 and d & (d - 1) == 0


@triton.jit
def online_softmax_step(s, m, l_sum):
    """Scores ``s [G, N]`` of one key tile (``-inf`` where dead) into the running max ``m [G]``
    and sum ``l_sum [G]``: -> (new max, the factor ``alpha`` that rescales what was accumulated,
    the tile's probabilities ``[G, N]``, new sum)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    prob = tl.exp(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(prob, axis=1)
    return m_new, alpha, prob, l_sum


@triton.jit
def slice_weight(m, top):
    """A key slice's weight in the split-K combine: ``exp(m - top)`` against the largest max
    ``top``, 0 for a slice that saw no live key."""
    return tl.where(m > EMPTY * 0.5, tl.exp(m - top), 0.0)
