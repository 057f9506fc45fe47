"""Token counts the start-up warm-up prefills, so no kernel compiles inside a served request.

Triton compiles one variant per kernel configuration, and our kernels pick configurations from
the token count ``T`` of a forward: the fused MoE's tile table steps at ``T * top_k / experts``
rows an expert; the mHC mix kernel's token block steps at 256 and 2048 rows and its split count
(a constexpr block) follows ``T`` in smaller steps; Triton specialises integer arguments on
``== 1`` and divisibility by 16, and pointers on 16-byte alignment (a bf16 view ``T`` rows in is
aligned when ``T % 8 == 0``). Measured on an H200 (``scripts/probe_first_calls.py``): after the
old 16-token warm-up, first prefills of 257-4104 tokens took 0.5-6.3 s (against 7-55 ms
afterwards), which is where the benchmark's multi-second TTFT went.

The grid: ``n``, ``n + 1`` and ``n + 8`` for every ``n = 2^k`` and ``3 * 2^k`` up to the
prefill chunk. Each of the tile steps spans at least a factor 1.5 of ``T``, so the grid lands in
each, in all three alignment classes.
"""

from __future__ import annotations


def warmup_token_counts(limit: int) -> list[int]:
    """Ascending distinct token counts in ``[1, limit]`` (``limit >= 1``), ``limit`` included."""
    if limit < 1:
        raise ValueError(f"warm-up limit must be >= 1, got {limit}")
    counts = {1, limit}
    base = 2
    while base <= limit:
        for n in (base, 3 * base // 2):
            counts |= {n, n + 1, n + 8}
        base *= 2
    return sorted(c for c in counts if c <= limit)
