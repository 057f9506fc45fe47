"""Random DeepSeek V4 compressor decode problems for the compressor kernel's tests and its
benchmark: a compressor with random position biases and norm and the YaRN rotary it applies
(:func:`random_compressor`, also the prefill and FP8 KV checks' compressor), a slot store full of
random pending and previous-block rows and entries, and a shuffled block table whose last slot is
scratch (padding rows write there)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.layers.attention.dsv4_compressor import KVCompressor
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.layers.rotary_embedding import InterleavedRotaryEmbedding, RopeSpec, YarnScaling
from sglang.srt.mem_cache.deepseek_v4_slot_pool import CompressorSlots

HIDDEN = 32


@dataclass(frozen=True)
class Case:
    compressor: KVCompressor
    rotary: InterleavedRotaryEmbedding
    store: CompressorSlots
    table: torch.Tensor
    real_slots: int  # slots 0 .. real_slots - 1 are requests; the last one is scratch
    null_block: int


def random_compressor(
    hidden: int,
    dim: int,
    ratio: int,
    *,
    overlap: bool,
    device: str,
    g: torch.Generator,
    rope_dim: int = 16,
) -> tuple[KVCompressor, InterleavedRotaryEmbedding]:
    """A float32 compressor whose position biases and norm weights are drawn from ``g``, and the
    YaRN rotary (``rope_dim`` wide) it applies."""
    spec = LayerBuildSpec(dtype=torch.float32, device=device)
    comp = KVCompressor(hidden, dim, ratio, spec, overlap=overlap, rms_eps=1e-6)
    with torch.no_grad():
        comp.ape.copy_(torch.randn(comp.ape.shape, generator=g, device=device))
        comp.norm.weight.copy_(torch.rand(dim, generator=g, device=device) + 0.5)
    yarn = YarnScaling(factor=4.0, original_max_position_embeddings=64, attention_factor=1.25)
    rotary = InterleavedRotaryEmbedding(RopeSpec(rope_dim, 10000.0, yarn), device=device)
    return comp, rotary


def make_case(
    ratio: int,
    overlap: bool,
    dim: int,
    entry_dtype: torch.dtype,
    device: str,
    seed: int,
    real_slots: int = 6,
) -> Case:
    g = torch.Generator(device).manual_seed(seed)
    comp, rotary = random_compressor(HIDDEN, dim, ratio, overlap=overlap, device=device, g=g)
    block_tokens, max_blocks = 4 * ratio, 3  # 4 entries a block, 12 a request
    num_blocks = real_slots * max_blocks
    store = CompressorSlots.allocate(
        real_slots + 1, num_blocks, block_tokens, ratio, dim,
        overlap=overlap, dtype=entry_dtype, device=torch.device(device),
    )  # fmt: skip
    # Fresh random state everywhere (a reused slot holds its former owner's rows).
    for t in (store.pending_kv, store.pending_score, store.prev_kv, store.prev_score):
        if t is not None:
            t.copy_(torch.randn(t.shape, generator=g, device=device) * 2)
    store.entries.copy_(torch.randn(store.entries.shape, generator=g, device=device))
    perm = torch.randperm(num_blocks, generator=g, device=device)
    table = torch.full((real_slots + 1, max_blocks), num_blocks, dtype=torch.long, device=device)
    table[:real_slots] = perm.view(real_slots, max_blocks)
    return Case(comp, rotary, store, table, real_slots, num_blocks)
