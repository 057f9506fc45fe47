"""Kimi K3's batched absorbed MLA decode (every single-token row of a forward in one padded pass,
``mla_absorbed_batch``) equals the per-request absorbed path it replaces.

Fresh random weights. The NoPE MLA layer alone (fp32 and bf16, with and without q LoRA): requests
of uneven lengths, 1 included, prefilled per request, then several decode steps and a mixed
forward (a prefill chunk between decode rows) on per-request and on paged latents (blocks of 4 in a
shared pool), with the padded-row bound small enough to split the batch into groups; the batched
rows match the per-request path to fp32 rounding (bf16: to its rounding of the output). The tiny
K3 model (CONFIG_A paged, CONFIG_B unpaged; fp32) decodes several steps with both paths: equal
logits. On a GPU, the layer at K3's latent widths (512 + 64) in bf16 on paged latents runs its
batched rows through the flash-decoding kernel: equal to the torch pass to bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.attention.mla_absorbed_batch import decode_chunks
from sglang.srt.layers.attention.mla_nope import MLANoPEAttention, MLANoPEConfig, MLASegment
from sglang.srt.layers.build_spec import LayerBuildSpec
from sglang.srt.mem_cache.block_pool import BlockPool
from sglang.srt.mem_cache.growable_rows import GrowableRows
from sglang.srt.mem_cache.kimi_k3_cache import MLALatentCache
from sglang.srt.mem_cache.paged_block_table import PagedBlockTable
from sglang.srt.mem_cache.paged_rows import PagedRows, append_one_each
from sglang.srt.models.kimi_k3 import KimiK3ForCausalLM
from sglang.test.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.kimi_k3_tiny import CONFIG_A, CONFIG_B, make_model, tokens
from sglang.test.run import run_this_file

register_cpu_ci(est_time=8)
register_cuda_ci(est_time=20, suite="h200-1gpu")  # its @pytest.mark.gpu tests

H, HEADS, KV_LORA, NOPE, ROPE, V = 48, 3, 32, 16, 8, 12
LAT = KV_LORA + ROPE
LENGTHS = (1, 2, 5, 9, 17, 3)  # uneven, 1 included; decode steps cross blocks of 4
STEPS, BLOCK = 4, 4


def test_decode_chunks_bound_the_padded_rows() -> None:
    lengths = [5, 1, 40, 7, 7, 3, 100, 2]
    groups = decode_chunks(lengths, 20)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 20
    assert [6] in groups and [2] in groups  # each over the bound runs alone
    assert decode_chunks(lengths, 10**6) == [sorted(range(8), key=lambda i: lengths[i])]
    with pytest.raises(ValueError, match="max_rows"):
        decode_chunks(lengths, 0)


def test_append_one_each_needs_reserved_blocks_and_one_store() -> None:
    caches, table = _caches(True, torch.float32)
    assert table is not None
    views = [c.rows for c in caches[:2]]
    assert all(isinstance(v, PagedRows) for v in views)
    table.ensure(0, 5)
    table.ensure(1, 1)
    new = torch.randn(2, LAT)
    append_one_each(views, new)  # type: ignore[arg-type]
    assert torch.equal(views[0].rows(), new[:1]) and torch.equal(views[1].rows(), new[1:])
    with pytest.raises(RuntimeError, match="reserved"):  # request 1 holds one block of 4 rows
        for _ in range(4):
            append_one_each(views, new)  # type: ignore[arg-type]
    other = PagedRows(torch.zeros(3, BLOCK, LAT), table.table[2], table.blocks(2))
    with pytest.raises(ValueError, match="one store"):
        append_one_each([views[0], other], new)  # type: ignore[list-item]


def _layer(q_lora: int | None, dtype: torch.dtype, seed: int) -> MLANoPEAttention:
    layer = MLANoPEAttention(
        MLANoPEConfig(H, HEADS, q_lora, KV_LORA, NOPE, ROPE, V, 1e-6), LayerBuildSpec(dtype=dtype)
    )
    _randomize(layer, torch.Generator().manual_seed(seed), dtype)
    return layer


def _randomize(layer: MLANoPEAttention, g: torch.Generator, dtype: torch.dtype | None) -> None:
    """Norm weights near 1, matrices ~ N(0, 1/fan_in), drawn on the CPU from ``g`` and rounded to
    ``dtype`` (None: each parameter's own)."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "layernorm" in name:
                v = torch.rand(p.shape, generator=g) + 0.5
            else:
                v = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
            p.copy_(v.to(dtype or p.dtype))


def _caches(paged: bool, dtype: torch.dtype) -> tuple[list[MLALatentCache], PagedBlockTable | None]:
    if not paged:
        return [MLALatentCache(GrowableRows(LAT, dtype=dtype)) for _ in LENGTHS], None
    need = sum(-(-(n + STEPS + 3) // BLOCK) for n in LENGTHS)
    # A store of random rows: what a former owner's rows would leave in reused blocks.
    store = torch.randn(need + 1, BLOCK, LAT).to(dtype)
    store[-1] = float("nan")  # the null block: the padded gather must not let it through
    table = PagedBlockTable(BlockPool(need, BLOCK), rows=len(LENGTHS), max_tokens=64)
    caches = [
        MLALatentCache(PagedRows(store, table.table[r], table.blocks(r)))
        for r in range(len(LENGTHS))
    ]
    return caches, table


def _run(
    layer: MLANoPEAttention,
    caches: list[MLALatentCache],
    table: PagedBlockTable | None,
    xs: list[torch.Tensor],
    lens: list[list[int]],
) -> list[torch.Tensor]:
    """Forward each ``xs[k]`` with segments of ``lens[k]`` rows (in request order)."""
    outs = []
    for x, seg_lens in zip(xs, lens):
        segs, start = [], 0
        for r, n in enumerate(seg_lens):
            if table is not None:
                table.ensure(r, len(caches[r]) + n)
            segs.append(MLASegment(start, n, caches[r]))
            start += n
        with torch.no_grad():
            outs.append(layer(x, segs))
    return outs


@pytest.mark.parametrize("paged", [False, True], ids=["unpaged", "paged"])
@pytest.mark.parametrize(
    "q_lora, dtype", [(None, torch.float32), (20, torch.float32), (20, torch.bfloat16)]
)
def test_batched_decode_equals_per_request(
    paged: bool, q_lora: int | None, dtype: torch.dtype
) -> None:
    layer = _layer(q_lora, dtype, seed=3)
    g = torch.Generator().manual_seed(5)
    n = len(LENGTHS)
    # prefill each request alone (its own forward), STEPS decode steps, then one mixed forward:
    # request 2 gets a 3-token chunk, every other request one token.
    lens = [[m if r == i else 0 for r in range(n)] for i, m in enumerate(LENGTHS)]
    lens += [[1] * n for _ in range(STEPS)] + [[3 if r == 2 else 1 for r in range(n)]]
    xs = [(torch.randn(sum(ls), H, generator=g) * 2).to(dtype) for ls in lens]
    ref_caches, ref_table = _caches(paged, dtype)
    layer.batched_decode = False
    ref = _run(layer, ref_caches, ref_table, xs, lens)
    layer.batched_decode, layer.max_padded_rows = True, 24  # groups of a few requests
    caches, table = _caches(paged, dtype)
    got = _run(layer, caches, table, xs, lens)
    # measured 4.5e-7 fp32, 0 bf16 (the fp32 maths agree well below one bf16 rounding)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    worst = 0.0
    for k, (a, b) in enumerate(zip(got, ref)):
        err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
        assert err <= tol, f"forward {k}: rel max err {err:.2e}"
        worst = max(worst, err)
    print(f"batched vs per-request MLA rows ({dtype}): rel max err {worst:.2e}")
    if dtype == torch.float32:
        assert all(torch.equal(a.rows.rows(), b.rows.rows()) for a, b in zip(caches, ref_caches))


def _set_batched(model: KimiK3ForCausalLM, on: bool) -> None:
    for layer in model.decoder_layers:
        if isinstance(layer.self_attn, MLANoPEAttention):
            layer.self_attn.batched_decode = on
            layer.self_attn.max_padded_rows = 30


# Two of the four (config, cache) pairs keep the file fast; the layer test covers both caches.
@pytest.mark.parametrize(
    "raw, paged", [(CONFIG_A, True), (CONFIG_B, False)], ids=["A-paged", "B-unpaged"]
)
def test_model_decode_logits_batched_equal_per_request(raw: dict, paged: bool) -> None:
    model = make_model(raw, seed=11)
    if paged:
        need = 2 * sum(-(-(n + STEPS) // BLOCK) for n in LENGTHS)
        model.enable_slot_pool(2 * len(LENGTHS), 64, num_blocks=need, block_tokens=BLOCK)
    new = model.new_pooled_cache if paged else model.new_request_cache
    seqs = [tokens(n + STEPS, seed=20 + i) for i, n in enumerate(LENGTHS)]
    runs = []
    for on in (False, True):
        _set_batched(model, on)
        caches = [new() for _ in LENGTHS]
        for seq, n, cache in zip(seqs, LENGTHS, caches):
            model.prefill(seq[:n], cache)
        steps = []
        for t in range(STEPS):
            ids = torch.stack([seq[n + t] for seq, n in zip(seqs, LENGTHS)])
            steps.append(model.decode(ids, caches))
        runs.append(torch.stack(steps))
    ref, got = runs
    err = float((got - ref).abs().max() / ref.abs().max())
    print(f"batched vs per-request logits: rel max err {err:.2e}")
    # Measured 1.1e-5 (A) and 3.7e-6 (B): the layer's ~1e-7 fp32 reordering, amplified by the
    # random layers after it (a wrong mask or gather is off by O(1)).
    assert err < 5e-5, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_decode_equals_torch_pass_gpu() -> None:
    heads, hidden, steps, block = 8, 256, 4, 16
    lens = [2, 15, 16, 17, 300, 1000]  # decode steps cross the 16-row block edges
    cfg = MLANoPEConfig(hidden, heads, 64, 512, 128, 64, 128, 1e-6)
    layer = MLANoPEAttention(cfg, LayerBuildSpec(dtype=torch.bfloat16, device="cuda"))
    g = torch.Generator().manual_seed(9)
    _randomize(layer, g, None)
    xs = [(torch.randn(n, hidden, generator=g) * 2).to(torch.bfloat16).cuda() for n in lens]
    xs += [(torch.randn(len(lens), hidden, generator=g) * 2).to(torch.bfloat16).cuda()] * steps
    outs = []
    for on in (False, True):
        layer.decode_kernel = on
        need = sum(-(-(n + steps) // block) for n in lens)
        table = PagedBlockTable(
            BlockPool(need, block), rows=len(lens), max_tokens=2048, device="cuda"
        )
        store = torch.randn(need + 1, block, 576, generator=g).to(torch.bfloat16).cuda()
        caches = [
            MLALatentCache(PagedRows(store, table.table[r], table.blocks(r)))
            for r in range(len(lens))
        ]
        prefill = [[n if r == i else 0 for r in range(len(lens))] for i, n in enumerate(lens)]
        got = _run(layer, caches, table, xs, prefill + [[1] * len(lens)] * steps)
        outs.append(torch.cat(got[len(lens) :]).float())
    ref, got = outs
    err = float((got - ref).abs().max() / ref.abs().max())
    print(f"layer decode, kernel vs torch pass (bf16): rel max err {err:.2e}")
    assert err < 2e-2, err


if __name__ == "__main__":
    run_this_file(__file__)
