"""Group routed (token, slot) pairs by expert, each expert's run padded to a tile of rows.

The grouped GEMMs of the fused MoE take rows ``block_m`` at a time, all of one expert. Given
``topk_ids`` [T, k], the flattened index ``t*k + s`` of every routed pair is placed in its
expert's segment of ``sorted_token_ids``; each segment is padded up to a multiple of ``block_m``
with the sentinel ``T*k`` (the GEMMs mask those rows). ``expert_ids[b]`` names the expert of
block ``b`` (-1 past the used part), and ``num_tokens_post_padded`` is the used length.

Ids outside ``[0, num_experts)`` (-1 marks a slot masked out, e.g. an expert on another EP rank)
are skipped. The output size is fixed by the shapes alone (no host sync, CUDA-graph safe): at
most ``min(E, T*k)`` experts are non-empty, so ``P = T*k + min(E, T*k)*(block_m - 1)`` rounded
up to ``block_m`` always suffices, and stays small at decode.

On CUDA two Triton launches do the work (count + scan in one program, then a parallel scatter
with atomics, so the order inside a segment is not fixed); elsewhere a torch version with a
stable order. Either order gives the same GEMM rows.

Half tiles (:func:`moe_align_half_tiles`): segments padded to ``block_m / 2`` only, and a tile
table that covers each segment with whole ``block_m``-row tiles and, where the segment leaves
exactly half a tile, one half-height tile at its end. An expert of 192 rows then computes 192
rows (one whole tile and one half) instead of 256: the prefill GEMMs' padding at 100-300 rows
an expert. The scan program writes the table too (no extra launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.triton_dispatch import triton_can_run


def padded_size(num_slots: int, block_m: int, num_experts: int) -> int:
    """The fixed length P of ``sorted_token_ids`` for ``num_slots`` = T*k routed pairs."""
    worst = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit
def _align_scan_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    cursor_ptr,
    tiles_ptr,
    num_tiles_ptr,
    num_slots,
    num_experts,
    padded_len,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    TILES: tl.constexpr,
):
    # One program: count per expert, pad, scan, then describe every block and fill sentinels;
    # with TILES also the table of 2*BLOCK_M-row tiles (a half one closing an odd segment).
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for start in range(0, num_slots, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
        e = tl.where((e >= 0) & (e < num_experts), e, num_experts)  # bin E collects the skipped
        counts += tl.histogram(e, NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    is_expert = bins < num_experts
    padded = tl.where(is_expert, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + bins, ends - padded, mask=is_expert)
    total = tl.sum(padded, axis=0)
    tl.store(ntpp_ptr, total)
    ends = tl.where(is_expert, ends, 2147483647)  # non-expert bins never count as "ended"
    num_blocks = padded_len // BLOCK_M
    for b0 in range(0, num_blocks, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        row = blk * BLOCK_M
        # The block's expert is the number of segments that end at or before its first row.
        eid = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        eid = tl.where(row < total, eid, -1)
        tl.store(expert_ids_ptr + blk, eid, mask=blk < num_blocks)
    if TILES:
        _tile_table(
            tiles_ptr, num_tiles_ptr, padded, is_expert, num_blocks, BLOCK_M, NUM_BINS, BLOCK_B
        )
    for p0 in range(0, padded_len, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        tl.store(
            sorted_ptr + offs,
            num_slots + tl.zeros((BLOCK,), dtype=tl.int32),
            mask=offs < padded_len,
        )


@triton.jit
def _tile_table(
    tiles_ptr,
    num_tiles_ptr,
    padded,
    is_expert,
    max_tiles,
    HALF: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # ``padded`` [bins]: each expert's segment length, a multiple of HALF. Tile t of the table is
    # (first row, expert, 1 if half height else 0); the experts wholly before t are those whose
    # tiles end at or before it, and sums over them give t's first tile and first row (no gather
    # from registers: sums of masked [BLOCK_T, bins] tiles, as for the block experts).
    halves = padded // HALF
    n_tiles = (halves + 1) // 2
    tile_ends = tl.cumsum(n_tiles, axis=0)
    total = tl.sum(n_tiles, axis=0)
    tl.store(num_tiles_ptr, total)
    tile_ends = tl.where(is_expert, tile_ends, 2147483647)
    bins = tl.arange(0, NUM_BINS)
    for t0 in range(0, max_tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        before = tile_ends[None, :] <= t[:, None]
        eid = tl.sum(before.to(tl.int32), axis=1)
        first_tile = tl.sum(tl.where(before, n_tiles[None, :], 0), axis=1)
        seg_start = tl.sum(tl.where(before, padded[None, :], 0), axis=1)
        seg_len = tl.sum(tl.where(bins[None, :] == eid[:, None], padded[None, :], 0), axis=1)
        used = t < total
        offset = (t - first_tile) * (2 * HALF)
        row0 = tl.where(used, seg_start + offset, 0)
        half = tl.where(used & (seg_len - offset == HALF), 1, 0)
        ok = t < max_tiles
        tl.store(tiles_ptr + 3 * t, row0, mask=ok)
        tl.store(tiles_ptr + 3 * t + 1, tl.where(used, eid, -1), mask=ok)
        tl.store(tiles_ptr + 3 * t + 2, half, mask=ok)


@triton.jit
def _align_scatter_kernel(
    ids_ptr, sorted_ptr, cursor_ptr, num_slots, num_experts, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
    valid = (offs < num_slots) & (e >= 0) & (e < num_experts)
    e = tl.where(valid, e, 0)
    pos = tl.atomic_add(cursor_ptr + e, 1, mask=valid, sem="relaxed")
    tl.store(sorted_ptr + pos, offs, mask=valid)


def _align_triton(
    ids: torch.Tensor, block_m: int, num_experts: int, length: int, tiles: bool = False
) -> tuple[torch.Tensor, ...]:
    num_slots = ids.numel()
    dev = ids.device
    sorted_ids = torch.empty(length, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(length // block_m, dtype=torch.int32, device=dev)
    ntpp = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    table = torch.empty((length // block_m if tiles else 1, 3), dtype=torch.int32, device=dev)
    num_tiles = torch.empty(1, dtype=torch.int32, device=dev)
    num_bins = triton.next_power_of_2(num_experts + 1)
    _align_scan_kernel[(1,)](
        ids,
        sorted_ids,
        expert_ids,
        ntpp,
        cursor,
        table,
        num_tiles,
        num_slots,
        num_experts,
        length,
        BLOCK_M=block_m,
        NUM_BINS=num_bins,
        BLOCK=1024,
        BLOCK_B=max(1, 8192 // num_bins),
        TILES=tiles,
        num_warps=8,
    )
    if num_slots:
        block = 256
        _align_scatter_kernel[(triton.cdiv(num_slots, block),)](
            ids, sorted_ids, cursor, num_slots, num_experts, BLOCK=block, num_warps=4
        )
    if tiles:
        return sorted_ids, expert_ids, ntpp, table, num_tiles
    return sorted_ids, expert_ids, ntpp


def _check_align_args(block_m: int, num_experts: int) -> None:
    if block_m <= 0 or num_experts <= 0:
        raise ValueError(f"block_m and num_experts must be positive, got {block_m}, {num_experts}")


def moe_align_block_size_torch(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch version (any device, stable order inside a segment); same outputs."""
    _check_align_args(block_m, num_experts)
    num_slots = topk_ids.numel()
    length = padded_size(num_slots, block_m, num_experts)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    seg_start = torch.cat([ends - padded, ends.new_full((1,), length)])  # skipped -> slot P
    raw_start = torch.cumsum(counts, 0) - counts
    sorted_key, order = torch.sort(key, stable=True)
    rank = torch.arange(num_slots, device=dev) - raw_start[sorted_key]
    dest = torch.where(sorted_key < num_experts, seg_start[sorted_key] + rank, length)
    buf = torch.full((length + 1,), num_slots, dtype=torch.int32, device=dev)
    buf.scatter_(0, dest, order.to(torch.int32))
    total = padded.sum()
    rows = torch.arange(0, length, block_m, device=dev)
    eid = torch.searchsorted(ends, rows, right=True)
    expert_ids = torch.where(rows < total, eid, -1).to(torch.int32)
    return buf[:length], expert_ids, total.to(torch.int32).reshape(1)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_ids`` [T, k] -> ``(sorted_token_ids int32 [P], expert_ids int32 [P/block_m],
    num_tokens_post_padded int32 [1])``; see the module docstring. Triton on CUDA (and under
    ``TRITON_INTERPRET=1``), torch elsewhere."""
    if not triton_can_run(topk_ids):
        return moe_align_block_size_torch(topk_ids, block_m, num_experts)
    return moe_align_block_size_triton(topk_ids, block_m, num_experts)


def moe_align_block_size_triton(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_align_block_size` in Triton alone, for launchers that run only where Triton
    runs (the Triton MegaMoE): CUDA tensors, or any under ``TRITON_INTERPRET=1``."""
    _check_align_args(block_m, num_experts)
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    return _align_triton(ids, block_m, num_experts, padded_size(ids.numel(), block_m, num_experts))


def half_tile_table_torch(
    expert_ids: torch.Tensor, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile table of :func:`moe_align_half_tiles` from an alignment to ``block_m // 2``
    (its ``expert_ids`` per half block): (table int32 [n_half_blocks, 3], num_tiles int32 [1])."""
    half = block_m // 2
    n = expert_ids.shape[0]
    dev = expert_ids.device
    used = expert_ids[expert_ids >= 0].to(torch.int64)
    num_experts = int(used.max()) + 1 if used.numel() else 1
    halves = torch.bincount(used, minlength=num_experts)
    n_tiles = (halves + 1) // 2
    tile_ends = torch.cumsum(n_tiles, 0)
    seg_start = (torch.cumsum(halves, 0) - halves) * half
    total = int(n_tiles.sum())
    t = torch.arange(total, device=dev)
    eid = torch.searchsorted(tile_ends, t, right=True)
    offset = (t - (tile_ends[eid] - n_tiles[eid])) * block_m
    table = torch.zeros((n, 3), dtype=torch.int32, device=dev)
    table[:, 1] = -1
    table[:total, 0] = (seg_start[eid] + offset).to(torch.int32)
    table[:total, 1] = eid.to(torch.int32)
    table[:total, 2] = (halves[eid] * half - offset == half).to(torch.int32)
    return table, torch.tensor([total], dtype=torch.int32, device=dev)


def moe_align_half_tiles(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_align_block_size` to ``block_m // 2`` (its three outputs, segments padded to
    half tiles), then ``(tiles int32 [P / (block_m/2), 3], num_tiles int32 [1])``: tile ``t`` of
    the first ``num_tiles`` is ``(first row, expert, half)``, ``block_m`` rows, or ``block_m/2``
    where ``half`` is 1 (only an expert's last tile, when its segment is an odd number of half
    tiles); the rest of the table is ``(0, -1, 0)``. Tiles follow the segments in expert order."""
    if block_m < 2 or block_m % 2:
        raise ValueError(f"half tiles need an even block_m, got {block_m}")
    half = block_m // 2
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if not triton_can_run(topk_ids):
        sorted_ids, expert_ids, ntpp = moe_align_block_size_torch(topk_ids, half, num_experts)
        return sorted_ids, expert_ids, ntpp, *half_tile_table_torch(expert_ids, block_m)
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    length = padded_size(ids.numel(), half, num_experts)
    return _align_triton(ids, half, num_experts, length, tiles=True)  # type: ignore[return-value]


@triton.jit
def _align_one_token_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    num_slots,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # Slot s has block s to itself: its row s*BLOCK_M holds it, the rest of the block pads.
    offs = tl.arange(0, BLOCK)
    length = num_slots * BLOCK_M
    row = tl.where(offs % BLOCK_M == 0, offs // BLOCK_M, num_slots)
    tl.store(sorted_ptr + offs, row, mask=offs < length)
    s = tl.arange(0, BLOCK_S)
    e = tl.load(ids_ptr + s, mask=s < num_slots, other=-1)
    tl.store(expert_ids_ptr + s, tl.where((e >= 0) & (e < num_experts), e, -1), mask=s < num_slots)
    tl.store(ntpp_ptr, length)


def moe_align_one_token(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GEMMs' row blocks for a single token ([1, k] ids, decode at batch 1): each slot gets a
    block of its own (its k experts are distinct, so nothing is shared), no sort and one small
    launch instead of two. Same outputs' shapes and meaning as :func:`moe_align_block_size`
    (``P = k * block_m``, a masked slot's block has expert -1), except that blocks are in slot
    order, not expert order: for the two-launch GEMMs, which take blocks in any order."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != 1:
        raise ValueError(f"moe_align_one_token takes [1, k] ids, got {tuple(topk_ids.shape)}")
    if block_m <= 0 or num_experts <= 0:
        raise ValueError(f"block_m and num_experts must be positive, got {block_m}, {num_experts}")
    ids = topk_ids.reshape(-1)
    num_slots = ids.numel()
    length = num_slots * block_m
    dev = ids.device
    if not triton_can_run(topk_ids):
        sorted_ids = torch.full((length,), num_slots, dtype=torch.int32, device=dev)
        sorted_ids[::block_m] = torch.arange(num_slots, dtype=torch.int32, device=dev)
        valid = (ids >= 0) & (ids < num_experts)
        expert_ids = torch.where(valid, ids, -1).to(torch.int32)
        return sorted_ids, expert_ids, torch.tensor([length], dtype=torch.int32, device=dev)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    sorted_ids = torch.empty(length, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_slots, dtype=torch.int32, device=dev)
    ntpp = torch.empty(1, dtype=torch.int32, device=dev)
    _align_one_token_kernel[(1,)](
        ids,
        sorted_ids,
        expert_ids,
        ntpp,
        num_slots,
        num_experts,
        BLOCK_M=block_m,
        BLOCK=triton.next_power_of_2(max(length, 16)),
        BLOCK_S=triton.next_power_of_2(max(num_slots, 16)),
        num_warps=1,
    )
    return sorted_ids, expert_ids, ntpp


def moe_align_any_order(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row blocks for GEMMs that take blocks in any order (the two-launch fused MoE): one
    token (batch-1 decode) gets a block a slot (:func:`moe_align_one_token`, one launch instead
    of the sort's two), more tokens the expert-sorted blocks of :func:`moe_align_block_size`."""
    if topk_ids.shape[0] == 1:
        return moe_align_one_token(topk_ids, block_m, num_experts)
    return moe_align_block_size(topk_ids, block_m, num_experts)
