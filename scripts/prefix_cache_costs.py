"""What the prefix cache's choices cost at full model size: bytes (from the slot pools and memory
models the engine allocates) and time (copies on this device), for what it shares by block and
what it snapshots, against the alternatives. The numbers behind docs/prefix_caching.md.

Shapes: DeepSeek V4 at the bench model's attention widths (head 512, indexer 128, window 128,
bf16) over 43 layers (2 window-only, then ratio 4 and 128 alternating: an assumed mix); Kimi K3
(69 KDA layers of 96 x 128 heads, fp32 state; 24 MLA layers of 512 + 64 latents, bf16) whole
and on one of 8 ranks. Blocks of 256 tokens (both models' default).

Per model, bytes of: one block of the shared state (entries and indexer keys / MLA latents); one
state snapshot (``SlotBlocks.edge_state``); and the alternatives: the raw window KV paged by block
(DeepSeek V4), a snapshot away from a block edge (with the compressors' pending rows), a
snapshot at every block (Kimi K3). Then the time of a snapshot save + load, and of copying a
7168-token prefix's shared state (what sharing by reference saves on every hit).
Usage: python scripts/prefix_cache_costs.py [--device cuda] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.deepseek_v4_cache import DeepseekV4CacheShape
from sglang.srt.mem_cache.deepseek_v4_slot_pool import DeepseekV4SlotPool
from sglang.srt.mem_cache.kimi_k3_cache import KimiK3CacheShape
from sglang.srt.mem_cache.kimi_k3_slot_pool import KimiK3SlotPool
from sglang.srt.mem_cache.memory_models.deepseek_v4 import CacheShape
from sglang.srt.mem_cache.memory_models.kimi_k3 import KimiK3MemoryModel
from sglang.srt.mem_cache.memory_models.memory_model import MemoryModel
from sglang.srt.mem_cache.slot_blocks import SlotBlocks, SlotPoolSize
from sglang.srt.mem_cache.state_snapshots import StateSnapshots

B = 256
PREFIX = 7168
DSV4_RATIOS = (0, 0, *([4, 128] * 20), 4)
DSV4_KINDS = tuple({0: "sliding", 4: "csa", 128: "hca"}[r] for r in DSV4_RATIOS)
HEAD, INDEX, WINDOW = 512, 128, 128


def mib(n: float) -> str:
    return f"{n / (1 << 20):8.2f} MiB"


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def time_snapshot(pool: SlotBlocks, device: torch.device, repeats: int) -> tuple[int, float]:
    snaps = StateSnapshots(pool.edge_state(), 2)

    def save_load() -> None:
        row = snaps.save(0)
        snaps.load(row, 1)
        snaps.release(row)

    return snaps.row_bytes(), timed(save_load, device, repeats)


@dataclass(frozen=True)
class PoolCosts:
    """What one pool's prefix caching costs: bytes of a block of the shared state and of one
    state snapshot, the time of a snapshot save + load and of copying a ``PREFIX``-token prefix's
    shared state."""

    block: float
    snapshot: int
    t_snapshot: float
    t_copy: float

    def print_times(self, shared: str) -> None:
        """The two time lines; ``shared``: what the pool shares by block."""
        snap_ms, copy_ms = self.t_snapshot * 1e3, self.t_copy * 1e3
        print(f"  snapshot save + load: {snap_ms:.3f} ms; copying a {PREFIX}-token prefix's")
        print(
            f"  {shared} instead of sharing them: {copy_ms:.3f} ms ({mib(self.block * PREFIX / B)})"
        )


# Both pools: two slots, and blocks of ``B`` tokens for two prefixes (the copy's source and target).
POOL_SIZE = SlotPoolSize(2, 2 * PREFIX, num_blocks=2 * PREFIX // B, block_tokens=B)


def pool_costs(
    pool: SlotBlocks,
    memory_model: MemoryModel,
    stores: list[torch.Tensor],
    device: torch.device,
    repeats: int,
) -> PoolCosts:
    """``pool``'s costs, its bytes checked against the memory model the engine budgets with;
    ``stores``: its paged tensors of shared state."""
    row, t_snap = time_snapshot(pool, device, repeats)
    assert row == memory_model.snapshot_bytes(), (row, memory_model.snapshot_bytes())
    block = memory_model.bytes_per_cached_token() * B
    return PoolCosts(block, row, t_snap, time_prefix_copy(stores, device, repeats))


def time_prefix_copy(stores: list[torch.Tensor], device: torch.device, repeats: int) -> float:
    """Copy ``PREFIX`` tokens' blocks of every paged store into other blocks (a hit that copied
    its prefix instead of sharing it)."""
    n = PREFIX // B
    src = torch.arange(n, device=device)
    dst = torch.arange(n, 2 * n, device=device)

    def copy() -> None:
        for s in stores:
            s.index_copy_(0, dst, s.index_select(0, src))

    return timed(copy, device, repeats)


def dsv4(device: torch.device, repeats: int) -> None:
    dtype = torch.bfloat16
    shape = CacheShape(
        num_layers=len(DSV4_RATIOS),
        hidden_size=4096,
        hc_mult=4,
        vocab_size=129280,
        head_dim=HEAD,
        index_head_dim=INDEX,
        sliding_window=WINDOW,
        compress_ratios=DSV4_RATIOS,
        attn_types=DSV4_KINDS,
        dtype_bytes=2,
    )
    pool = DeepseekV4SlotPool(
        DeepseekV4CacheShape(
            attn_types=DSV4_KINDS,
            compress_ratios=DSV4_RATIOS,
            sliding_window=WINDOW,
            head_dim=HEAD,
            index_head_dim=INDEX,
            dtype=dtype,
        ),
        POOL_SIZE,
        device=device,
    )
    raw_block = len(DSV4_RATIOS) * B * HEAD * 2
    pending = sum(
        2 * r * (2 if kind == "csa" else 1) * HEAD * 4
        + (2 * r * 2 * INDEX * 4 if kind == "csa" else 0)
        for r, kind in zip(DSV4_RATIOS, DSV4_KINDS)
        if r
    )
    stores = [
        c.entries
        for layer in pool.layers
        for c in (layer.compressor, layer.indexer)
        if c is not None
    ]
    costs = pool_costs(pool, shape, stores, device, repeats)
    print(f"DeepSeek V4 ({len(DSV4_RATIOS)} layers: window {WINDOW}, ratios 4/128), bf16")
    print(f"  shared, a block of {B} tokens (entries + indexer keys):  {mib(costs.block)}")
    print(f"  alternative: the raw window KV paged by block:          {mib(raw_block)}")
    print(f"  snapshot at a block edge (window rings + overlap rows): {mib(costs.snapshot)}")
    print(
        f"  alternative: a snapshot off an edge (+ pending rows):   {mib(costs.snapshot + pending)}"
    )
    costs.print_times("entries")


def k3(device: torch.device, repeats: int, tp: int) -> None:
    kinds = tuple("mla" if (i + 1) % 4 == 0 or i == 92 else "kda" for i in range(93))
    shape = KimiK3CacheShape(
        layer_kinds=kinds, kda_heads=96 // tp, kda_head_dim=128, conv_size=4, latent_dim=576
    )
    mm = KimiK3MemoryModel(
        pool=shape, hidden_size=7168, vocab_size=163840, bank_rows=8, dtype_bytes=2,
        state_dtype_bytes=4,
    )  # fmt: skip
    pool = KimiK3SlotPool(shape, POOL_SIZE, dtype=torch.bfloat16, device=device)
    stores = [s for s in pool.latents if s is not None]
    costs = pool_costs(pool, mm, stores, device, repeats)
    print(f"Kimi K3 ({kinds.count('kda')} KDA, {kinds.count('mla')} MLA layers), TP{tp} rank")
    print(f"  shared, a block of {B} tokens (MLA latents):             {mib(costs.block)}")
    print(f"  snapshot at a block edge (KDA conv + recurrent states):  {mib(costs.snapshot)}")
    print(f"  alternative: a snapshot at every block (per block):      {mib(costs.snapshot)}")
    print(f"    = {costs.snapshot / costs.block:.0f}x the block's latents")
    costs.print_times("latents")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device: {device}\n")
    dsv4(device, args.repeats)
    print()
    k3(device, args.repeats, tp=8)
    if device.type == "cuda":
        print()
        k3(device, args.repeats, tp=1)


if __name__ == "__main__":
    main()
