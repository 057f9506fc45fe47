"""Random absorbed-MLA decode problems over a paged latent store: queries, the absorbed
``w_kc``/``w_vc`` and the latents of several requests in a shuffled store of fixed-row blocks,
with NaN wherever a correct kernel must not read (rows past a length, the null block)."""

from __future__ import annotations

import torch

# Latent, rope, nope and value widths, and rows a block, small enough for the interpreter.
SMALL_DIMS: tuple[int, int, int, int] = (64, 16, 16, 16)
SMALL_BLOCK_ROWS = 4


def make_paged(
    lens: list[int],
    heads: int,
    g: torch.Generator,
    *,
    device: str = "cpu",
    rows: int = SMALL_BLOCK_ROWS,
    dims: tuple[int, int, int, int] = SMALL_DIMS,
) -> tuple[torch.Tensor, ...]:
    """Queries ``[bs, heads, nope + rope]`` (bf16), fp32 ``w_kc``/``w_vc``, and the latents of
    requests of ``lens`` rows in a shuffled store of ``rows``-row blocks (NaN past each length
    and in the null block, the last one); the table covers the longest request. ``dims``: latent,
    rope, nope and value widths."""
    lat, rope, nope, v = dims
    bs, nb = len(lens), -(-max(lens) // rows)
    n_blocks = sum(-(-n // rows) for n in lens)
    store = torch.randn(n_blocks + 1, rows, lat + rope, generator=g).to(torch.bfloat16)
    store[-1] = float("nan")
    order = torch.randperm(n_blocks, generator=g).tolist()
    table = torch.full((bs, nb), n_blocks, dtype=torch.long)
    for b, n in enumerate(lens):
        held = [order.pop() for _ in range(-(-n // rows))]
        table[b, : len(held)] = torch.tensor(held, dtype=torch.long)
        if n % rows:
            store[held[-1], n % rows :] = float("nan")  # the last block's unused rows
    q = (torch.randn(bs, heads, nope + rope, generator=g) * 2).to(torch.bfloat16)
    w_kc = (torch.randn(heads, nope, lat, generator=g) * nope**-0.5).to(torch.bfloat16).float()
    w_vc = (torch.randn(heads, v, lat, generator=g) * lat**-0.5).to(torch.bfloat16).float()
    lengths = torch.tensor(lens, dtype=torch.long)
    return tuple(t.to(device) for t in (q, w_kc, w_vc, store, table, lengths))
