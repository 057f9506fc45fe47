"""Token counts the start-up warm-up prefills, so no kernel compiles inside a served request.

Triton compiles one variant per kernel configuration, and our kernels pick configurations from
the token count ``T`` of a forward: the fused MoE's tile table steps at ``T * top_k / experts``
rows an expert, the mHC kernels switch from one pass to a loop above 256 rows, and Triton
specialises integer arguments on ``== 1`` and divisibility by 16. A warm-up of one 16-token
prefill compiled only the smallest variants; the first batch of full-length prompts then compiled
the rest inside the timed run (seconds of TTFT). Every power of two up to the prefill chunk, and
each plus one (not divisible by 16), reaches every tile step and both specialisations.
"""

from __future__ import annotations


def warmup_token_counts(limit: int) -> list[int]:
    """Ascending token counts ``<= limit`` (``limit >= 1``): ``1``, then ``2^k`` and ``2^k + 1``
    for ``2^k < limit``, and ``limit`` itself."""
    if limit < 1:
        raise ValueError(f"warm-up limit must be >= 1, got {limit}")
    counts = {1, limit}
    n = 2
    while n < limit:
        counts |= {n, n + 1}
        n *= 2
    return sorted(c for c in counts if c <= limit)
